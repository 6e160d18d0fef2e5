"""The engine's request and its counters (:class:`kvtvm.engine.Engine` fills them)."""

from __future__ import annotations

import dataclasses

__all__ = ["Request", "ServeStats"]


@dataclasses.dataclass
class Request:
    """One generation request.

    ``prompt`` is the token ids (a sequence, a numpy array or a 1-D integer tensor; the engine
    keeps them as a list of ints when the request arrives). ``arrival`` is the engine step at
    which it is submitted. ``stop_token_ids`` end it (the stop token is kept in ``output``, as
    transformers' ``generate`` does); None takes the engine's (the model's end-of-sequence
    tokens). ``temperature`` 0 is greedy; otherwise tokens are drawn from the ``top_k`` most
    likely tokens (None or 0: all) and within them the top-``top_p`` mass
    (:func:`kvtvm.engine.sampling.sample`) with a generator seeded by ``seed`` (None: by
    ``rid``, or a hash of a ``rid`` that is not an int). The engine fills ``output``,
    ``status`` (``"waiting"``, ``"running"``, ``"done"``, ``"rejected"``, ``"aborted"``),
    ``finish_reason`` (``"stop"`` or ``"length"``), ``error`` (why it was rejected, or aborted
    by a step that raised), ``prefix_hit_tokens`` and the wall-clock times ``t_arrived``,
    ``t_first``, ``t_done``.
    """

    rid: int
    prompt: list
    max_new_tokens: int
    arrival: int = 0
    stop_token_ids: tuple | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int | None = None
    output: list = dataclasses.field(default_factory=list)
    status: str = "waiting"
    finish_reason: str = ""
    error: str = ""
    prefix_hit_tokens: int = 0
    seq_id: int = -1
    arrived_step: int = -1           # the engine step it entered the queue
    admitted_step: int = -1
    finished_step: int = -1
    prefilled: int = 0               # prompt tokens in the cache
    t_arrived: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    generator: object = None

    @property
    def length(self) -> int:
        """Tokens the cache holds at most when the request finishes (its last generated token
        is never fed back)."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def ttft(self) -> float:
        """Seconds from arrival to the first generated token."""
        return self.t_first - self.t_arrived if self.t_first else 0.0

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first."""
        n = len(self.output) - 1
        return (self.t_done - self.t_first) / n if n > 0 and self.t_done else 0.0


@dataclasses.dataclass
class ServeStats:
    """Counters of an engine's run."""

    steps: int = 0
    prefill_tokens: int = 0          # prompt tokens computed
    prompt_tokens: int = 0           # prompt tokens of admitted requests
    prefix_hit_tokens: int = 0       # prompt tokens read from the prefix cache
    generated_tokens: int = 0
    decode_steps: int = 0            # steps run with the decode kernel
    mixed_steps: int = 0             # steps mixing prompt chunks with ongoing decodes
    waited: int = 0                  # requests that waited in the queue at least one step
    peak_running: int = 0            # most requests in the cache at once
    peak_live_bytes: int = 0
    allocated_bytes: int = 0
    seconds: float = 0.0             # wall time inside serve(), summed over its calls

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0
