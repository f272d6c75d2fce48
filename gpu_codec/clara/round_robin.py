"""Round-robin processors: which client's turn it is, by round or by a persistent cursor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidInputError
from .context import AppContext, DataContext
from .processors import DataProcessor

__all__ = ["RoundRobinClientFieldProcessor", "RoundRobinClientStateProcessor"]


def _clients(clients: Sequence[str]) -> list[str]:
    if isinstance(clients, str) or not isinstance(clients, Sequence) or not clients:
        raise InvalidInputError(f"clients must be a non-empty list of client names, got {clients!r}")
    if not all(isinstance(c, str) and c for c in clients) or len(set(clients)) != len(clients):
        raise InvalidInputError(f"clients must be distinct non-empty strings, got {list(clients)!r}")
    return list(clients)


class RoundRobinClientFieldProcessor(DataProcessor):
    """Name, in the data context's metadata field ``field``, the client whose turn it is this round:
    ``clients[(round - start_round) % len(clients)]`` (a pure function of the round, so every party computes
    the same answer without shared state).

    >>> from gpu_codec.clara import AppContext, DataContext
    >>> p, ctx = RoundRobinClientFieldProcessor(["a", "b", "c"]), DataContext(model={})
    >>> p.process(ctx, AppContext(round_number=4)); ctx.get_metadata("round_robin_client")
    'b'
    """

    def __init__(self, clients: Sequence[str], field: str = "round_robin_client", start_round: int = 0) -> None:
        super().__init__()
        self.clients = _clients(clients)
        self.field = field
        self.start_round = int(start_round)

    def get_config(self) -> dict[str, Any]:
        return {"clients": self.clients, "field": self.field, "start_round": self.start_round}

    def client_for(self, round_number: int) -> str:
        """The client whose turn round ``round_number`` is."""
        return self.clients[(int(round_number) - self.start_round) % len(self.clients)]

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        self._check_abort()
        data_ctx.add_metadata(self.field, self.client_for(app_ctx.round_number))


class RoundRobinClientStateProcessor(DataProcessor):
    """Keep the round-robin state across runs: a cursor over ``clients`` that moves one step per processed
    data context (whatever the round numbers, so skipped or repeated rounds do not skip a client), and how many
    turns each client has had. Each run writes ``{"client", "next", "turn"}`` into metadata field ``field``
    (``turn``: that client's turn count, from 1). Clients listed in ``app_ctx["unavailable_clients"]`` are
    passed over. :meth:`get_state` / :meth:`set_state` save and restore the state (JSON).

    >>> from gpu_codec.clara import AppContext, DataContext
    >>> p = RoundRobinClientStateProcessor(["a", "b"])
    >>> for _ in range(3):
    ...     ctx = DataContext(model={}); p.process(ctx, AppContext())
    >>> ctx.get_metadata("round_robin_state"), p.get_state()["turns"]
    ({'client': 'a', 'next': 'b', 'turn': 2}, {'a': 2, 'b': 1})
    """

    def __init__(self, clients: Sequence[str], field: str = "round_robin_state") -> None:
        super().__init__()
        self.clients = _clients(clients)
        self.field = field
        self._cursor = 0
        self._turns = dict.fromkeys(self.clients, 0)

    def get_config(self) -> dict[str, Any]:
        return {"clients": self.clients, "field": self.field}

    def get_state(self) -> dict[str, Any]:
        """The state (JSON): the cursor and the turn counts."""
        return {"cursor": self._cursor, "turns": dict(self._turns)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`get_state` (for the same clients)."""
        turns = state.get("turns") if isinstance(state, Mapping) else None
        cursor = state.get("cursor") if isinstance(state, Mapping) else None
        if not isinstance(turns, Mapping) or set(turns) != set(self.clients) or not isinstance(cursor, int):
            raise InvalidInputError(f"not a round-robin state for clients {self.clients}: {state!r}")
        self._cursor = cursor % len(self.clients)
        self._turns = {c: int(turns[c]) for c in self.clients}

    def _next_available(self, start: int, unavailable: set) -> int:
        for i in range(len(self.clients)):
            j = (start + i) % len(self.clients)
            if self.clients[j] not in unavailable:
                return j
        raise InvalidInputError(f"every client is unavailable: {sorted(unavailable)}")

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        self._check_abort()
        unavailable = set(app_ctx.get("unavailable_clients") or ())
        i = self._next_available(self._cursor, unavailable)
        client = self.clients[i]
        nxt = self.clients[self._next_available(i + 1, unavailable)]
        self._turns[client] += 1
        self._cursor = (i + 1) % len(self.clients)
        data_ctx.add_metadata(self.field, {"client": client, "next": nxt, "turn": self._turns[client]})
