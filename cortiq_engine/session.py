"""A conversation's KV cache kept across turns.

Each turn the caller renders the whole conversation through the chat template and
passes its token ids. ``ChatSession`` compares them with the tokens whose rows the
cache already holds (last turn's conversation plus the answer it generated), keeps
the longest common prefix, rolls the cache back to it and forwards only the rest.
Usually that prefix is everything up to the new turn; when the template renders an
earlier turn differently (or the answer's text re-tokenizes differently) less is
reused, never a wrong row. A recurrent (linear-attention) state rolls back only inside
its last forward call; when the prefix ends before that, the turn starts from a fresh
state. The last token of the conversation is always forwarded: its hidden row gives the
first logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cortiq_engine.generate import GenerationResult
from cortiq_engine.sampling import SamplingConfig


@dataclass
class Turn:
    result: GenerationResult
    conversation_tokens: int  # the rendered conversation this turn answered
    reused_tokens: int  # its prefix that was already in the cache
    forwarded_tokens: int  # its suffix forwarded this turn (conversation - reused)

    def to_json(self) -> dict:
        return {
            "conversation_tokens": self.conversation_tokens,
            "reused_tokens": self.reused_tokens,
            "forwarded_tokens": self.forwarded_tokens,
            **self.result.to_json(),
        }


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    """One conversation on an ``Engine``: its state, and the ids whose rows it holds.

    ``drafter`` (an ``mtp.Drafter``, from ``Engine.drafter``): every turn decodes
    speculatively; the drafter keeps the backbone rows of the cached prefix alongside
    the cache.
    """

    def __init__(self, engine, drafter=None):
        self.engine = engine
        self.drafter = drafter
        self.state = engine.new_state()
        self.cached: list[int] = []

    def reset(self) -> None:
        """Forget the cache (``/reset``, or after an eviction or an interrupted forward)."""
        self.state = self.engine.new_state()
        self.cached = []
        if self.drafter is not None:
            self.drafter.reset()

    def reusable(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` the cache can serve (at most all but the last)."""
        n = common_prefix(self.cached, ids)
        if self.drafter is not None:
            n = min(n, self.drafter.hist_len)
        return max(min(n, len(ids) - 1), 0)

    def generate(self, ids: Sequence[int], config: SamplingConfig | None = None, **options) -> Turn:
        """Answer the conversation ``ids`` (rendered with the generation prompt);
        ``options`` (max_tokens, stop, evict, ignore_eos, logprobs, on_token, on_text)
        are ``Engine.generate``'s."""
        eng = self.engine
        ids = [int(i) for i in ids]
        keep = self.reusable(ids)
        if not self.state.can_truncate(keep):
            # A recurrent (linear-attention) state cannot go back past its last forward
            # call: forward the whole conversation again on a fresh state.
            self.reset()
            keep = 0
        self.state.truncate(keep)
        self.cached = self.cached[:keep]
        history, new = ids[:keep], ids[keep:]
        try:
            drafter = self.drafter if self.drafter is not None else False
            res = eng.generate(new, config, state=self.state, history=history, speculative=drafter, **options)
        except BaseException:
            # An error before the prefill left the cache at the kept prefix; one inside
            # a forward (Ctrl-C, a full context) may have left layers unequal: start over.
            if self.state.length != keep or self.state.position != keep:
                self.reset()
            raise
        if res.evictions:
            self.reset()  # the cache no longer starts at the conversation's start
        else:
            # Every emitted token but the last was forwarded (generate's contract).
            self.cached = ids + res.token_ids[:-1]
            assert len(self.cached) == self.state.length
        return Turn(res, conversation_tokens=len(ids), reused_tokens=keep, forwarded_tokens=len(new))
