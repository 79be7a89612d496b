"""A TCP forwarder for the relay tests: counts the bytes each way and can cut every connection
(and refuse new ones) until restored, like a network that drops and comes back."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    """Listens on 127.0.0.1:`port` and forwards each connection to 127.0.0.1:`target_port`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.down_bytes = 0  # from the target (the publisher) to the client (the relay)
        self.up_bytes = 0
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._open = True
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._open:
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, server))
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                dst.sendall(data)
                with self._lock:
                    if down:
                        self.down_bytes += len(data)
                    else:
                        self.up_bytes += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Drop every connection and refuse new ones until restore()."""
        self._open = False
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def restore(self) -> None:
        self._open = True

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()
