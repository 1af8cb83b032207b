"""A subscriber to vLLM's KV-event publisher on 127.0.0.1, for the engine suites.

vLLM's ZMQ publisher binds an endpoint with a wildcard and connects to any other, so the
subscriber binds its SUB socket (a free port on 127.0.0.1, no race for it) and vLLM connects
to ``tcp://127.0.0.1:<port>``. Messages are vLLM's: (topic, sequence number, msgpack of a
``KVEventBatch``), decoded with vLLM's own types.

A PUB socket drops what it publishes to a peer whose subscription it has not seen, and a SUB
socket sends its subscription over a new connection only when its owner next calls into it:
so once the engine is up, :meth:`wait_connected` waits for vLLM's connection and lets the SUB
socket send it. Whatever is still missing from the sequence is fetched, as vLLM's own
subscriber example does, from the publisher's replay endpoint (a ROUTER it binds; the request
is the first wanted sequence number, 8 bytes big endian; the answer one message per batch,
then sequence number -1).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

END_SEQ = -1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class KVEventSubscriber:
    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self.context = zmq.Context()
        self.live = self.context.socket(zmq.SUB)
        self.live.setsockopt_string(zmq.SUBSCRIBE, "")
        self._monitor = self.live.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.endpoint = f"tcp://127.0.0.1:{self.live.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay_endpoint = f"tcp://127.0.0.1:{_free_port()}"
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: dict[int, Any] = {}  # sequence number -> KVEventBatch
        self.live_batches = 0  # how many arrived on the SUB socket (not replayed)

    def config(self) -> dict[str, Any]:
        """vLLM's ``kv_events_config`` that publishes to this subscriber."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
        }

    def wait_connected(self, timeout: float = 120.0) -> None:
        """Wait until vLLM's publisher has connected, then hand it this socket's subscription."""
        from zmq.utils.monitor import recv_monitor_message

        if not self._monitor.poll(int(timeout * 1000)):
            raise AssertionError(f"vLLM's KV-event publisher never connected to {self.endpoint}")
        recv_monitor_message(self._monitor)
        self.live.getsockopt(self._zmq.EVENTS)  # the SUB socket takes the connection in
        # and its subscription crosses to the publisher, which reads it at its next send;
        # a batch that still beats it is fetched by replay
        time.sleep(0.2)

    @property
    def events(self) -> list[Any]:
        """Every event received, in the publisher's order."""
        return [event for seq in sorted(self.batches) for event in self.batches[seq].events]

    def receive(self, until: Callable[[list[Any]], bool], timeout: float = 120.0) -> list[Any]:
        """Events until ``until(events)`` holds (live, then replayed); fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not until(self.events):
            if time.monotonic() > deadline:
                raise AssertionError(f"KV events never satisfied the test: {self.events}")
            self._drain_live(wait_ms=300)
            if not until(self.events):
                self._replay()
        return self.events

    def _drain_live(self, wait_ms: int) -> None:
        while self.live.poll(wait_ms):
            _topic, seq, payload = self.live.recv_multipart()
            self.batches[int.from_bytes(seq, "big")] = self.decoder.decode(payload)
            self.live_batches += 1
            wait_ms = 0

    def _replay(self) -> None:
        zmq = self._zmq
        asker = self.context.socket(zmq.DEALER)
        try:
            asker.connect(self.replay_endpoint)
            asker.send_multipart((b"", (0).to_bytes(8, "big")))
            while asker.poll(5000):
                _empty, _topic, seq, payload = asker.recv_multipart()
                number = int.from_bytes(seq, "big", signed=True)
                if number == END_SEQ:
                    return
                self.batches.setdefault(number, self.decoder.decode(payload))
            raise AssertionError("vLLM's replay endpoint did not answer")
        finally:
            asker.close(linger=0)

    def close(self) -> None:
        self.live.disable_monitor()
        self._monitor.close(linger=0)
        self.live.close(linger=0)
        self.context.term()
