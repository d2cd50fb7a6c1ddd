"""The interaction cache: every completion an agent asked for, linked into a tree, rewarded, exported.

An ``Interaction`` is one completion call: the messages (or raw prompt) it was given, the exact
prompt and output token ids, per-token behaviour log-probs and policy versions, the response
message and its tool calls. Interactions are linked by longest prefix: a chat turn's parent is the
interaction whose messages plus its assistant reply are the longest prefix of the turn's messages
(for raw completions: whose prompt plus output token ids are the longest prefix of the prompt).

Rewards are set per interaction (``set_reward``) or on the newest one (``set_last_reward``). An
interaction left without a reward scores 0; where that is the last turn of a branch (a leaf: the
episode's final reward missing) it is warned about, once per process. Earlier turns without a
reward are the usual case (a final reward is credited back to them) and are not warned about.
``apply_discount(gamma)`` walks the
tree from the leaves up: each parent's reward becomes its own plus ``gamma`` × its child's (the
mean over children where a turn branched), so an early turn is credited with what it led to.

Export (``export``):
- ``"individual"``: one ``Trajectory`` per interaction (its prompt, its output, its discounted reward).
- ``"concat"``: one ``Trajectory`` per root-to-leaf path, the turns concatenated into one sequence;
  ``completion_mask`` is 1 on model-generated tokens only (tool results and user turns are 0), and
  the reward is the path's return from its first turn (``sum_k gamma^k r_k``). A turn whose prompt
  does not extend its parent's tokens (its history was rewritten) starts a new sequence, whose reward
  is the path's return from that turn on; a sequence keeps its first turn's images.
"""

from __future__ import annotations

import inspect
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from areno.rewards.sandbox import as_reward
from areno.types import Trajectory

logger = logging.getLogger("areno.workflows")

_warned_unrewarded = False
"""Whether an episode whose last turn had no reward was warned about (later ones: DEBUG)."""


def _reward_value(reward: Any) -> float:
    """``reward`` as a float (``as_reward``); a coroutine (``client.reward_fn(...)`` not awaited) is a
    TypeError saying to await it."""
    if inspect.isawaitable(reward):
        if inspect.iscoroutine(reward):
            reward.close()  # never awaited: closed here, so Python does not warn about it again
        raise TypeError(
            f"the reward is a {type(reward).__name__}, not a number: await it "
            "(reward = await client.reward_fn(...) or await client.ascore(sample, completion))"
        )
    return as_reward(reward)


ExportStyle = Literal["individual", "concat"]


def _canon_message(message: dict[str, Any]) -> tuple:
    """What makes two messages 'the same turn' for linking (ids of tool calls ignored)."""
    calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ())
    return (message.get("role"), message.get("content") or "", calls, message.get("name"))


@dataclass(kw_only=True)
class Interaction:
    """One completion call of an agent."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    messages: list[dict[str, Any]] | None
    """Input messages of a chat call (None for a raw completion)."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str
    response: dict[str, Any]
    """The assistant message (chat) or ``{"text": ...}`` (raw completion)."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    """Own reward as set by the agent (None: not set)."""
    discounted_reward: float | None = None
    """Own reward plus discounted future; set by ``apply_discount``."""
    parent: Interaction | None = None
    children: list[Interaction] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def history_key(self) -> tuple:
        """The messages a child turn must start with: this turn's input and its reply."""
        assert self.messages is not None
        return tuple(_canon_message(m) for m in self.messages) + (_canon_message(self.response),)

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class InteractionCache:
    """All interactions of one episode (thread-safe; agents may issue calls concurrently)."""

    def __init__(self) -> None:
        self.interactions: dict[str, Interaction] = {}
        self._order: list[str] = []
        self._lock = threading.Lock()

    # ---- building the tree
    def find_chat_parent(self, messages: list[dict[str, Any]]) -> Interaction | None:
        """The chat interaction whose messages + reply are the longest prefix of ``messages``."""
        key = tuple(_canon_message(m) for m in messages)
        best, best_len = None, 0
        for inter in self.interactions.values():
            if inter.messages is None:
                continue
            hk = inter.history_key()
            if len(hk) > best_len and len(hk) <= len(key) and key[: len(hk)] == hk:
                best, best_len = inter, len(hk)
        return best

    def find_token_parent(self, prompt_ids: list[int]) -> Interaction | None:
        """The interaction whose prompt + output ids are the longest prefix of ``prompt_ids``."""
        best, best_len = None, 0
        for inter in self.interactions.values():
            full = inter.full_ids
            if len(full) > best_len and len(full) <= len(prompt_ids) and prompt_ids[: len(full)] == full:
                best, best_len = inter, len(full)
        return best

    def add(self, interaction: Interaction, parent: Interaction | None = None) -> Interaction:
        with self._lock:
            if parent is None:
                parent = (
                    self.find_chat_parent(interaction.messages)
                    if interaction.messages is not None
                    else self.find_token_parent(interaction.prompt_ids)
                )
            interaction.parent = parent
            if parent is not None:
                parent.children.append(interaction)
            self.interactions[interaction.id] = interaction
            self._order.append(interaction.id)
        return interaction

    def __len__(self) -> int:
        return len(self.interactions)

    def __getitem__(self, interaction_id: str) -> Interaction:
        try:
            return self.interactions[interaction_id]
        except KeyError:
            raise KeyError(
                f"no interaction {interaction_id!r} in this cache "
                f"(known: {self._order[:5]}{'…' if len(self._order) > 5 else ''})"
            ) from None

    @property
    def last(self) -> Interaction | None:
        return self.interactions[self._order[-1]] if self._order else None

    def ordered(self) -> list[Interaction]:
        return [self.interactions[i] for i in self._order]

    # ---- rewards
    def set_reward(self, interaction_id: str, reward: float) -> None:
        """Reward one interaction: a number or a bool (a str, None or an un-awaited coroutine is a TypeError)."""
        self[interaction_id].reward = _reward_value(reward)

    def set_last_reward(self, reward: float) -> None:
        """Reward the newest interaction (the usual 'final answer' reward)."""
        if self.last is None:
            raise ValueError("set_last_reward: the agent made no completion call in this episode")
        self.last.reward = _reward_value(reward)

    def apply_discount(self, gamma: float = 1.0) -> None:
        """Leaves up: ``discounted = own + gamma * mean(children's discounted)``; unset rewards count 0,
        and a leaf without one (a branch that ended without its final reward) is warned about once."""
        global _warned_unrewarded
        if not 0 <= gamma <= 1:
            raise ValueError(f"discount gamma must be in [0, 1], got {gamma}")
        leaves = [i.id for i in self.ordered() if i.reward is None and not i.children]
        if leaves:
            missing = sum(i.reward is None for i in self.ordered())
            logger.log(
                logging.DEBUG if _warned_unrewarded else logging.WARNING,
                "%d of %d interactions have no reward, among them %d that end the episode (%s); they count as 0. "
                "Return the final reward from the agent, or set one with client.set_reward(id, r) or "
                "client.set_last_reward(r) (warned once; later episodes are logged at DEBUG)",
                missing,
                len(self),
                len(leaves),
                ", ".join(leaves[:3]),
            )
            _warned_unrewarded = True
        for inter in reversed(self.ordered()):  # children are always added after their parent
            own = inter.reward if inter.reward is not None else 0.0
            if inter.children:
                future = sum(c.discounted_reward for c in inter.children) / len(inter.children)
                inter.discounted_reward = own + gamma * future
            else:
                inter.discounted_reward = own

    # ---- export
    def export(
        self,
        style: ExportStyle = "individual",
        *,
        gamma: float = 1.0,
        group_id: str = "",
        info: dict[str, Any] | None = None,
    ) -> list[Trajectory]:
        """Trajectories for training (runs ``apply_discount(gamma)`` first)."""
        if style not in ("individual", "concat"):
            raise ValueError(f"export style must be 'individual' or 'concat', got {style!r}")
        self.apply_discount(gamma)
        if style == "individual":
            return [self._individual(i, group_id, info) for i in self.ordered()]
        out = []
        for leaf in (i for i in self.ordered() if not i.children):
            path = []
            node: Interaction | None = leaf
            while node is not None:
                path.append(node)
                node = node.parent
            out.extend(self._concat(path[::-1], gamma, group_id, info))
        return out

    def _individual(self, inter: Interaction, group_id: str, info: dict[str, Any] | None) -> Trajectory:
        return Trajectory(
            prompt_ids=list(inter.prompt_ids),
            completion_ids=list(inter.output_ids),
            logprobs=list(inter.output_logprobs),
            versions=list(inter.output_versions),
            reward=float(inter.discounted_reward),
            group_id=group_id,
            finish_reason=inter.finish_reason,
            info={
                **(info or {}),
                **({"images": inter.info["images"]} if "images" in inter.info else {}),
                "interaction_id": inter.id,
                "num_turns": 1,
                "own_reward": inter.reward if inter.reward is not None else 0.0,
            },
        )

    def _concat(
        self, path: list[Interaction], gamma: float, group_id: str, info: dict[str, Any] | None
    ) -> list[Trajectory]:
        """One sequence per token-contiguous run of turns along ``path``."""
        segments: list[list[Interaction]] = [[path[0]]]
        for inter in path[1:]:
            prev = segments[-1][-1]
            if inter.prompt_ids[: len(prev.full_ids)] == prev.full_ids:
                segments[-1].append(inter)
            else:
                logger.warning(
                    "interaction %s does not extend its parent's tokens (its history was "
                    "re-rendered differently); it starts a new sequence",
                    inter.id,
                )
                segments.append([inter])
        trajs = []
        start = 0  # the path index of the segment's first turn
        for seg in segments:
            ids: list[int] = []
            mask: list[int] = []
            logp: list[float] = []
            vers: list[int] = []
            prompt_ids = list(seg[0].prompt_ids)
            covered = len(prompt_ids)
            for inter in seg:
                between = inter.prompt_ids[covered:]  # user / tool tokens added since the last turn
                ids += between
                mask += [0] * len(between)
                logp += [0.0] * len(between)
                vers += [-1] * len(between)
                ids += inter.output_ids
                mask += [1] * len(inter.output_ids)
                logp += inter.output_logprobs
                vers += inter.output_versions
                covered = len(inter.full_ids)
            # the return from the segment's first turn to the end of the path: a piece the tokens split
            # off (a re-rendered history) still leads to the reward its later turns earned
            ret = sum(gamma**k * (i.reward or 0.0) for k, i in enumerate(path[start:]))
            start += len(seg)
            trajs.append(
                Trajectory(
                    prompt_ids=prompt_ids,
                    completion_ids=ids,
                    logprobs=logp,
                    versions=vers,
                    reward=float(ret),
                    completion_mask=mask,
                    group_id=group_id,
                    finish_reason=seg[-1].finish_reason,
                    info={
                        **(info or {}),
                        **({"images": seg[0].info["images"]} if "images" in seg[0].info else {}),
                        "interaction_ids": [i.id for i in seg],
                        "num_turns": len(seg),
                        "turn_rewards": [i.reward or 0.0 for i in seg],
                    },
                )
            )
        return trajs
