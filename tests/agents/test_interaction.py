"""Tree linking, discounting and export of the interaction cache on hand-built conversations."""

import logging

import pytest

from areno.types import TokenBatch
from areno.workflows.interaction import Interaction, InteractionCache


def user(text):
    return {"role": "user", "content": text}


def asst(text):
    return {"role": "assistant", "content": text}


def chat(messages, reply, prompt_ids, output_ids, iid):
    return Interaction(
        id=iid,
        messages=messages,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        output_logprobs=[-0.1 * (i + 1) for i in range(len(output_ids))],
        output_versions=[7] * len(output_ids),
        finish_reason="stop",
        response=asst(reply),
    )


def build_tree():
    """a → b → c (a chain), and a → d (a branch off the first reply); token ids continue the parent's."""
    cache = InteractionCache()
    a = cache.add(chat([user("q")], "A", [1, 2], [10, 11], "a"))
    b = cache.add(chat([user("q"), asst("A"), user("more")], "B", [1, 2, 10, 11, 20], [12], "b"))
    c = cache.add(
        chat(
            [user("q"), asst("A"), user("more"), asst("B"), user("again")],
            "C",
            [1, 2, 10, 11, 20, 12, 21, 22],
            [13, 14, 15],
            "c",
        )
    )
    d = cache.add(chat([user("q"), asst("A"), user("other")], "D", [1, 2, 10, 11, 30], [16], "d"))
    return cache, a, b, c, d


def test_tree_links_by_longest_message_prefix():
    cache, a, b, c, d = build_tree()
    assert a.parent is None and b.parent is a and c.parent is b and d.parent is a
    assert a.children == [b, d] and b.children == [c] and c.children == [] and d.children == []
    # a new conversation (different first message) is a second root
    e = cache.add(chat([user("unrelated")], "E", [5], [6], "e"))
    assert e.parent is None
    # a turn whose history rewrites A's reply does not link to a
    f = cache.add(chat([user("q"), asst("not A"), user("x")], "F", [1, 2, 9], [6], "f"))
    assert f.parent is None


def test_token_prefix_linking_for_raw_completions():
    cache = InteractionCache()
    mk = lambda iid, p, o: Interaction(
        id=iid,
        messages=None,
        prompt_ids=p,
        output_ids=o,
        output_logprobs=[0.0] * len(o),
        output_versions=[0] * len(o),
        finish_reason="stop",
        response={"text": ""},
    )
    r = cache.add(mk("r", [1, 2], [3]))
    s = cache.add(mk("s", [1, 2, 3, 4], [5]))
    t = cache.add(mk("t", [1, 2, 3, 4, 5, 6], [7]))
    u = cache.add(mk("u", [1, 2, 9], [7]))  # does not extend r's tokens
    assert s.parent is r and t.parent is s and u.parent is None


def test_discounting_by_hand():
    cache, a, b, c, d = build_tree()
    cache.set_reward("a", 0.0)
    cache.set_reward("b", 0.5)
    cache.set_reward("c", 1.0)
    cache.set_reward("d", 0.2)
    cache.apply_discount(0.9)
    assert c.discounted_reward == pytest.approx(1.0)
    assert d.discounted_reward == pytest.approx(0.2)
    assert b.discounted_reward == pytest.approx(0.5 + 0.9 * 1.0)
    # a branched: the mean of its children's discounted rewards, times gamma
    assert a.discounted_reward == pytest.approx(0.0 + 0.9 * (1.4 + 0.2) / 2)
    cache.apply_discount(1.0)
    assert a.discounted_reward == pytest.approx((1.5 + 0.2) / 2)


def test_missing_reward_is_warned_and_zero(caplog, monkeypatch):
    monkeypatch.setattr("areno.workflows.interaction._warned_unrewarded", False)  # warned once per process
    cache, a, b, c, d = build_tree()
    cache.set_last_reward(1.0)  # d is the newest
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        cache.apply_discount(0.5)
    assert "3 of 4 interactions have no reward" in caplog.text and "set_last_reward" in caplog.text
    assert c.discounted_reward == 0.0 and a.discounted_reward == pytest.approx(0.5 * (0.0 + 1.0) / 2)
    with pytest.raises(ValueError, match="gamma"):
        cache.apply_discount(1.5)
    with pytest.raises(ValueError, match="no completion call"):
        InteractionCache().set_last_reward(1.0)


def test_export_individual():
    cache, a, b, c, d = build_tree()
    for iid, r in (("a", 0.0), ("b", 0.0), ("c", 1.0), ("d", 0.0)):
        cache.set_reward(iid, r)
    trajs = cache.export("individual", gamma=0.5, group_id="g")
    assert [t.info["interaction_id"] for t in trajs] == ["a", "b", "c", "d"]
    assert [t.reward for t in trajs] == pytest.approx([0.5 * (0.5 + 0.0) / 2, 0.5, 1.0, 0.0])
    tc = trajs[2]
    assert tc.prompt_ids == [1, 2, 10, 11, 20, 12, 21, 22] and tc.completion_ids == [13, 14, 15]
    assert tc.completion_mask == [1, 1, 1] and tc.versions == [7, 7, 7] and tc.group_id == "g"
    assert tc.logprobs == pytest.approx([-0.1, -0.2, -0.3])


def test_export_concat_masks_only_model_tokens():
    cache, a, b, c, d = build_tree()
    for iid, r in (("a", 0.0), ("b", 0.5), ("c", 1.0), ("d", 0.25)):
        cache.set_reward(iid, r)
    trajs = cache.export("concat", gamma=0.5)
    assert len(trajs) == 2  # one per leaf: a-b-c and a-d
    abc, ad = trajs
    assert abc.info["interaction_ids"] == ["a", "b", "c"] and ad.info["interaction_ids"] == ["a", "d"]
    assert abc.prompt_ids == [1, 2]
    assert abc.completion_ids == [10, 11, 20, 12, 21, 22, 13, 14, 15]
    assert abc.completion_mask == [1, 1, 0, 1, 0, 0, 1, 1, 1]
    assert abc.versions == [7, 7, -1, 7, -1, -1, 7, 7, 7]
    assert abc.logprobs == pytest.approx([-0.1, -0.2, 0.0, -0.1, 0.0, 0.0, -0.1, -0.2, -0.3])
    assert abc.reward == pytest.approx(0.0 + 0.5 * 0.5 + 0.25 * 1.0)  # the path's return from its first turn
    assert ad.completion_ids == [10, 11, 30, 16] and ad.completion_mask == [1, 1, 0, 1]
    assert ad.reward == pytest.approx(0.5 * 0.25)
    batch = TokenBatch.from_trajectories(trajs)
    # packed: the loss covers exactly the model tokens of both sequences
    assert batch.loss_mask_T.tolist() == [False, False] + [bool(m) for m in abc.completion_mask] + [False, False] + [
        bool(m) for m in ad.completion_mask
    ]


def test_concat_splits_where_tokens_do_not_continue(caplog):
    cache = InteractionCache()
    a = cache.add(chat([user("q")], "A", [1, 2], [10], "a"))
    # linked by messages, but its prompt was re-tokenised differently (no [1, 2, 10] prefix)
    b = cache.add(chat([user("q"), asst("A"), user("x")], "B", [1, 2, 99, 20], [11], "b"))
    assert b.parent is a
    cache.set_reward("b", 1.0)
    cache.set_reward("a", 0.0)
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        trajs = cache.export("concat", gamma=1.0)
    assert "starts a new sequence" in caplog.text
    assert [t.info["interaction_ids"] for t in trajs] == [["a"], ["b"]]
    assert trajs[1].prompt_ids == [1, 2, 99, 20] and trajs[1].completion_ids == [11]
    # walk16: each piece is credited with the path's return from its first turn: the split-off first turn
    # led to b's reward 1 (it had 0, its own piece's sum)
    assert [t.reward for t in trajs] == [1.0, 1.0]
    assert [t.reward for t in cache.export("concat", gamma=0.5)] == [0.5, 1.0]
    with pytest.raises(ValueError, match="export style"):
        cache.export("flat")


def test_concat_keeps_a_turns_images():
    """walk16: the concat export dropped info["images"] (the individual export kept them), so the trainer
    read a vision-language turn's image tokens as text."""
    cache = InteractionCache()
    inter = chat([user("what is this?")], "a cat", [1, 2], [10], "a")
    inter.info["images"] = "stand-in"
    cache.add(inter)
    cache.set_reward("a", 1.0)
    (traj,) = cache.export("concat")
    assert traj.info["images"] == "stand-in"
    (single,) = cache.export("individual")
    assert single.info["images"] == "stand-in"
