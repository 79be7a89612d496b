"""A real `vllm serve` (the OpenAI server, CPU build, tiny LLaVA) with shmstore's `shm` cache:
requests the server refuses after rendering and requests whose clients disconnect while queued
must not wedge the store. One server for the module (about 50 s to start on 2 cores).
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from tests._waiting import wait_for
from tests.conftest import new_name
from tests.vllm.tiny_llava import build

pytestmark = [pytest.mark.timeout(600), pytest.mark.serving]
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
        env = {**{k: v for k, v in os.environ.items() if k != "LOCAL_RANK"},
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
        end = time.monotonic() + 300
        while time.monotonic() < end:
            assert self.proc.poll() is None, log.read_text()[-5000:]
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise TimeoutError(log.read_text()[-5000:])

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

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)  # by pid: the server and what it spawned
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        for leftover in Path("/dev/shm").glob("vllm_dist_*"):  # vLLM's own, not ours
            leftover.unlink(missing_ok=True)


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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = build(tmp_path_factory.mktemp("tiny-llava"))
    srv = Server(model, new_name("serve"), tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    srv.stop()
    # the server's exit unlinked it, or (its API server SIGKILLed by vLLM's launcher) its
    # tracker process, which may still be at it when the launcher has exited
    wait_for(lambda: not Path("/dev/shm", srv.segment).exists(), 60, "the segment to go")


def test_refused_and_disconnected_requests_never_wedge_the_store(server: Server) -> None:
    first = server.chat(1)["choices"][0]["message"]["content"]
    # refused after rendering: the prompt fits, not with the image's 16 tokens
    too_long = "describe " + "the quick brown fox " * 60
    with pytest.raises(urllib.error.HTTPError) as refused:
        server.chat(100, text=too_long)
    assert refused.value.code == 400
    # three clients that hang up before their answers come, behind long requests that hold the
    # one sequence: each asks for a long answer and leaves after a third of the time one takes
    server.chat(199, max_tokens=MAX_MODEL_LEN - 40, ignore_eos=True)  # warm: the first is slow
    started = time.monotonic()
    server.chat(200, max_tokens=MAX_MODEL_LEN - 40, ignore_eos=True)
    one_long_s = time.monotonic() - started
    n_long = max(2, int(4 / one_long_s) + 1)  # about 4 s of work queued
    failed: list[BaseException] = []

    def run(call: Any, *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except BaseException as exc:  # a thread's exception would vanish: the test reports it
            failed.append(exc)

    longs = [threading.Thread(target=run, args=(server.chat, 200 + i),
                              kwargs={"max_tokens": MAX_MODEL_LEN - 40, "ignore_eos": True})
             for i in range(n_long)]
    for t in longs:
        t.start()
    time.sleep(0.3)
    aborted_before = server.metric("shmstore_vllm_settled_total", api_server="0", reason="aborted")
    leavers = [threading.Thread(target=run, args=(server.leave, 300 + i, one_long_s / 3),
                                kwargs={"max_tokens": MAX_MODEL_LEN - 40, "ignore_eos": True})
               for i in range(3)]
    for t in leavers:
        t.start()
    for t in leavers + longs:
        t.join(120)
    assert not failed, failed
    time.sleep(1.5)  # past SHMSTORE_VLLM_SETTLE_S
    inline = []
    for r in range(3):  # rounds of six new images, more than the store holds
        before = server.metric("shmstore_inline_fallbacks_total", api_server="0")
        for i in range(6):
            server.chat(1000 + 10 * r + i)
        inline.append(server.metric("shmstore_inline_fallbacks_total", api_server="0") - before)
    assert inline == [0, 0, 0]
    assert server.metric("shmstore_vllm_settled_total", api_server="0", reason="refused") == 1
    # hand-outs of leavers whose image no worker read are settled as aborted: 0 to 3 of them.
    # vLLM does not always keep the leavers behind the long requests (0, 2 and 3 in three
    # runs), and one whose image a worker read before its client left settles nothing. The
    # path itself is held deterministically by test_vllm_engine.py (aborts before any step).
    aborted = server.metric("shmstore_vllm_settled_total", api_server="0", reason="aborted")
    assert 0 <= aborted - aborted_before <= 3
    # each settled hand-out no worker read (the refused one, the aborted ones) holds an object
    # that the three rounds reached: withdrawn, not waited for
    assert server.metric("shmstore_withdrawn_total") >= 1 + aborted - aborted_before
    assert server.chat(1)["choices"][0]["message"]["content"] == first  # same image, same text
    assert server.metric("shmstore_reader_lag", reader="0") == 0
