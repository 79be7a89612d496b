"""A real `vllm serve` (the OpenAI server, CPU build, tiny LLaVA) started through `shmstore
serve` as the install guide prints it, and what its tests send it: chat requests with images,
clients that hang up, a media server for images behind URLs, and the metrics it scrapes. The
tests are in test_vllm_serve_shapes.py (bench/bench_serve.py starts its servers with it too).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shmstore.metrics import MIRRORED
from tests._waiting import wait_for

# `shmstore serve`, as the install guide prints it for the CPU build of vLLM
SHMSTORE = Path(sys.executable).with_name("shmstore")
MAX_MODEL_LEN = 256


class Server:
    def __init__(self, model: Path, segment: str, log: Path, *extra: str,
                 cache_gb: str = "0.00025", cache_type: str = "shm",
                 env: dict[str, str] | None = None) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.model, self.segment = str(model), segment
        # several API servers (or engines, each with its own): /metrics from copied values
        self.copied_metrics = "--api-server-count" in extra or "--data-parallel-size" in extra
        # vLLM's ZMQ sockets (one file each) go into a folder of this server's, removed at
        # stop: a killed server's are otherwise left in /tmp for good (inside the test
        # session's folder where there is one: removed at its end, a failed start's too)
        self.rpc_dir = tempfile.mkdtemp(prefix="vllm-rpc-",
                                        dir=os.environ.get("VLLM_RPC_BASE_PATH"))
        env = {**{k: v for k, v in os.environ.items() if k != "LOCAL_RANK"},
               "VLLM_RPC_BASE_PATH": self.rpc_dir,
               "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": segment, "SHMSTORE_VLLM_SETTLE_S": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(Path(__file__).parents[2]), **(env or {})}
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [str(SHMSTORE), "serve", self.model, "--host", "127.0.0.1",
             "--port", str(self.port), "--mm-processor-cache-type", cache_type,
             "--mm-processor-cache-gb", cache_gb,  # default: about six of these images
             "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1", "--enforce-eager",
             *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._wait_healthy(log)
        except BaseException:  # a start that fails or times out leaves no process behind
            self.stop()
            raise

    def _wait_healthy(self, log: Path) -> None:
        end = time.monotonic() + 300
        while time.monotonic() < end:
            assert self.proc.poll() is None, said(log)
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise TimeoutError(said(log))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def body(self, seed: int, text: str = "describe the image", *,
             part: dict[str, Any] | None = None, **extra: Any) -> bytes:
        part = part or {"type": "image_url", "image_url": {"url": image(seed)}}
        return json.dumps({"model": self.model, "max_tokens": 8, "temperature": 0, **extra,
                           "messages": [{"role": "user", "content": [
                               part, {"type": "text", "text": text}]}]}).encode()

    def chat(self, seed: int, text: str = "describe the image", timeout: float = 60, *,
             part: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        """A chat completion about image `seed` (or the content part `part`)."""
        request = urllib.request.Request(f"{self.url}/v1/chat/completions",
                                         self.body(seed, text, part=part, **extra),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]

    def leave(self, seed: int, after_s: float, **extra: Any) -> None:
        """Send a chat request, then hang up after `after_s` without reading the answer."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            body = self.body(seed, **extra)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(after_s)
            sock.shutdown(socket.SHUT_RDWR)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` with these labels (and this segment)."""
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        want = {**labels, "segment": self.segment}
        found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith(f"{name}{{") and want.items() <= _labels(line).items()]
        if not found:
            raise LookupError(f"no {name} {want} in /metrics")
        return sum(found)

    def metrics_as_of_now(self, timeout_s: float = 60) -> None:
        """Return once /metrics shows everything done before this call: with several API
        servers their values are copied into prometheus_client's files twice a second, so
        wait until each copier has made two more copies (one begun after now); with one API
        server /metrics is live and there is nothing to wait for."""
        def copies() -> dict[str, float]:
            text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
            return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines() if line.startswith(f"{MIRRORED}{{")}
        looked = copies()
        assert looked or not self.copied_metrics, f"no {MIRRORED} on /metrics"
        wait_for(lambda: all(copies().get(k, 0.0) >= n + 2 for k, n in looked.items()),
                 timeout_s, f"the metrics copiers to copy twice ({looked})")

    def stop(self) -> None:
        """Stop the server and what it spawned (by its process group), remove what vLLM
        leaves; idempotent."""
        with contextlib.suppress(ProcessLookupError):  # its group gone already
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        for leftover in Path("/dev/shm").glob("vllm_dist_*"):  # vLLM's own, not ours
            leftover.unlink(missing_ok=True)
        shutil.rmtree(self.rpc_dir, ignore_errors=True)


def said(log: Path) -> str:
    """A failed start's story: every line of the log that names shmstore (which process made,
    joined or served the store, what it dropped), then the log's end."""
    text = log.read_text()
    ours = [line for line in text.splitlines() if "shmstore" in line.lower()]
    return "\n".join(ours[-60:]) + "\n...\n" + text[-5000:]


def _labels(line: str) -> dict[str, str]:
    inside = line[line.index("{") + 1:line.rindex("}")]
    return dict((k, v.strip('"')) for k, v in (pair.split("=", 1) for pair in inside.split(",")
                                                if pair))


def image(seed: int, fmt: str = "PNG", side: int = 64, keep: float = 1.0) -> str:
    """A data URL of a random image: PNG (decoded eagerly) or JPEG (lazily, under shmstore);
    `keep` < 1 cuts its bytes short (a corrupt image whose header still opens)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    data = out.getvalue()[:int(len(out.getvalue()) * keep)]
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()


def _jpeg_bytes(seed: int) -> bytes:
    return base64.b64decode(image(seed, "JPEG", 256).split(",")[1])


class MediaServer:
    """Clients' images behind URLs: an HTTP server on 127.0.0.1 that serves .../SEED.jpg as
    `jpeg(SEED)` gives it (by default the JPEG of jpeg_part) and answers 404 for anything else
    (or where `jpeg` gives None)."""

    def __init__(self, jpeg: Callable[[int], bytes | None] = _jpeg_bytes) -> None:
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                name = self.path.rsplit("/", 1)[-1]
                data = None
                if name.endswith(".jpg") and name[:-4].isdigit():
                    data = jpeg(int(name[:-4]))
                self.send_response(200 if data else 404)
                self.send_header("Content-Type", "image/jpeg")
                self.send_header("Content-Length", str(len(data or b"")))
                self.end_headers()
                self.wfile.write(data or b"")

            def log_message(self, *args: Any) -> None:
                pass

        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def jpeg_part(seed: int, *, truncated: bool = False, uuid: str | None = None,
              data: bool = True) -> dict[str, Any]:
    """A chat content part with a 256x256 JPEG (cut in half: corrupt), a uuid, or the uuid
    alone (no data: the server must have the item already)."""
    url = image(seed, "JPEG", 256, keep=0.5 if truncated else 1.0)
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url} if data else None}
    if uuid is not None:
        part["uuid"] = uuid
    return part
