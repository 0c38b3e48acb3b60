"""Where the two sides of a stage meet: the RPCs a stage server answers, what a router asks of this peer's own stage
server, and what a stage host asks of a router. ``client/`` and ``server/`` import this leaf module, never each
other."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Optional, Protocol

from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

WAIT_LOG_PERIOD = 10.0  # seconds between two log lines about the same stage having no live peer


class StageService(ServicerBase):
    """The RPCs of a stage server, registered under the run id as namespace. Callers build their stubs from this
    class (``StageService.get_stub``); :class:`~lightning_swarm.server.stage_server.StageServer` answers them."""

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        """The same name for a handler and its stub, whichever subclass registers it."""
        name = f"StageService.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # an async generator, as hivemind expects of a streaming handler

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        raise NotImplementedError

    async def rpc_state(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield


class LocalStage(Protocol):
    """This peer's own stage server, as its router calls it without the network."""

    stage: int

    async def answer_tensors(self, kind: str, request: Any, caller: str = "this peer") -> list: ...


class Routes(Protocol):
    """What a stage host asks of this peer's router: to call its own stage directly, and which stages have peers;
    and what its stage server asks of it to hand a chained request on to the next stage
    (:mod:`~lightning_swarm.server.onward`)."""

    local_server: Optional[LocalStage]

    def call(
        self,
        stage: int,
        method: str,
        tensors: list,
        metadata: dict,
        batch: int,
        prefer: Optional[str] = None,
        check: Optional[Callable[[list], None]] = None,
        report: Optional[Callable[[Any], None]] = None,
        wait_timeout: Optional[float] = None,
        deadline: Optional[float] = None,
    ) -> tuple[list, str]: ...

    def call_peer(
        self,
        stage: int,
        peer: str,
        method: str,
        tensors: list,
        metadata: dict,
        batch: int,
        check: Optional[Callable[[list], None]] = None,
        count: bool = True,
        timeout: Optional[float] = None,
    ) -> list: ...

    def choose(self, stage: int, batch: int, exclude: frozenset = frozenset()) -> Optional[str]: ...

    def knows(self, stage: int, peer: str) -> bool: ...

    def is_banned(self, stage: int, peer: str) -> bool: ...

    def refresh(self, stage: int, force: bool = False) -> None: ...
