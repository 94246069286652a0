"""Random layouts against brute-force references (C1, C4, C5).

Layouts: up to 64 slots over a random number of storages (random sharing), random
frozen masks, random use orders in a session, some storage-less registrations. The
references below scan pairs with ``is``; the library uses one hash index.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tiegrad import EagerSession, Param, ParamList, dense_group_gradient
from tiegrad.params import canonical_indices

SHAPES = [(), (1,), (3,), (2, 2)]


@st.composite
def layouts(draw, max_slots=64):
    """(storage index per slot, frozen flag per slot, shape per storage, seed)."""
    n = draw(st.integers(0, max_slots))
    k = draw(st.integers(1, max(1, n)))
    owner = draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))
    frozen = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=k, max_size=k))
    return owner, frozen, shapes, draw(st.integers(0, 2**32 - 1))


def build(owner, frozen, shapes):
    bases = [Param(np.zeros(s, np.float32)) for s in shapes]
    # equal contents everywhere: only identity may decide aliasing (C1)
    return ParamList(bases[o].alias(requires_grad=not f) for o, f in zip(owner, frozen))


def brute_canonical(storages):
    out = []
    for i, st_i in enumerate(storages):
        if st_i is None:
            out.append(None)
            continue
        out.append(next(j for j in range(i + 1) if storages[j] is st_i))
    return out


def random_gradients(pl, rng):
    return [rng.standard_normal(p.shape).astype(np.float32) for p in pl]


@settings(max_examples=50, deadline=None)
@given(layouts())
def test_canonical_slot_indices_match_pairwise_scan(layout):  # C5
    owner, frozen, shapes, _ = layout
    pl = build(owner, frozen, shapes)
    storages = [None if f else p.storage for p, f in zip(pl, frozen)]
    assert pl.optimizer_storage() == storages
    assert pl.requires_grad_array() == [not f for f in frozen]
    slots = pl.canonical_slot_indices()
    assert slots == brute_canonical(storages)
    for i, c in enumerate(slots):
        assert (c is None) == frozen[i]
        if c is not None:
            assert c <= i and slots[c] == c  # no chains, never compressed
    assert canonical_indices(pl.storages()) == brute_canonical(pl.storages())


@settings(max_examples=50, deadline=None)
@given(layouts())
def test_canonical_gradients_match_list_order_sums(layout):  # C4, C5
    owner, frozen, shapes, seed = layout
    rng = np.random.default_rng(seed)
    pl = build(owner, frozen, shapes)
    grads = random_gradients(pl, rng)
    kept = [g.copy() for g in grads]
    slots = pl.canonical_slot_indices()
    sums = pl.canonical_gradients(slots, grads)
    assert len(sums) == len(pl)
    for c in range(len(pl)):
        members = [i for i in range(len(pl)) if slots[i] == c]
        if slots[c] != c:
            assert sums[c] is None
            continue
        if len(members) == 1:
            assert sums[c] is grads[c]  # a lone trainable slot keeps its gradient object
            continue
        expected = grads[members[0]]
        for i in members[1:]:
            expected = expected + grads[i]  # left fold in list order
        np.testing.assert_array_equal(sums[c], expected)
        assert ParamList.canonical_gradient(pl[c].shape, sums, c) is sums[c]
    for g, k in zip(grads, kept):
        np.testing.assert_array_equal(g, k)  # inputs are never written into


@settings(max_examples=50, deadline=None)
@given(layouts())
def test_sgd_step_writes_each_storage_once_from_its_sum(layout):  # C3, C4, C5
    owner, frozen, shapes, seed = layout
    rng = np.random.default_rng(seed)
    pl = build(owner, frozen, shapes)
    start = {id(p.storage): rng.standard_normal(p.shape).astype(np.float32) for p in pl}
    for p in pl:
        p.set_value(start[id(p.storage)])
    grads = random_gradients(pl, rng)
    expected = {}
    for i, p in enumerate(pl):
        if p.requires_grad:
            key = id(p.storage)
            expected[key] = grads[i] if key not in expected else expected[key] + grads[i]
    pl.sgd_step(0.125, grads)
    for p in pl:
        key = id(p.storage)
        want = start[key] - np.float32(0.125) * expected[key] if key in expected else start[key]
        np.testing.assert_array_equal(p.value, want)


class Handle:
    """A storage-less registration (never merged, C1)."""

    def __init__(self, shape, requires_grad):
        self.shape, self.dtype, self.requires_grad = shape, np.dtype(np.float32), requires_grad
        self.v = np.zeros(shape, np.float32)

    def get(self):
        return self.v

    def set(self, value):
        self.v = value


@st.composite
def use_orders(draw):
    """A layout, a random sequence of uses of its handles (plus storage-less ones)."""
    owner, frozen, shapes, seed = draw(layouts(max_slots=24))
    n = len(owner)
    extra = draw(st.integers(0, 3))
    uses = draw(st.lists(st.integers(0, n + extra - 1), max_size=40)) if n + extra else []
    extra_flags = draw(st.lists(st.booleans(), min_size=extra, max_size=extra))
    return owner, frozen, shapes, extra_flags, uses, seed


def brute_groups(regs, storages):
    """Trainable registrations by leaf, merged by a pairwise ``is`` scan of storages."""
    groups = []
    for leaf in sorted(regs):
        p = regs[leaf]
        if not p.requires_grad:
            continue
        st_ = storages.get(leaf)
        for g in groups:
            if st_ is not None and g[2] is st_:
                g[1].append(leaf)
                break
        else:
            groups.append((leaf, [leaf], st_, p))
    return groups


@settings(max_examples=50, deadline=None)
@given(use_orders())
def test_parameter_groups_and_group_gradients_match_brute_force(case):  # C1, C4
    owner, frozen, shapes, extra_flags, uses, seed = case
    rng = np.random.default_rng(seed)
    pl = build(owner, frozen, shapes)
    handles = list(pl) + [Handle((2,), not f) for f in extra_flags]
    s = EagerSession()
    refs = [s.use(handles[u]) for u in uses]
    regs, storages = s.parameter_registrations(), s.storage_registrations()
    assert [regs[r.id] for r in refs] == [handles[u] for u in uses]
    groups = s.parameter_groups()
    want = brute_groups(regs, storages)
    assert [(g.id, list(g.leaves), g.storage) for g in groups] == [w[:3] for w in want]
    for g, w in zip(groups, want):
        assert g.parameter is w[3]
    grads = {r.id: rng.standard_normal(r.shape).astype(np.float32) for r in refs}
    for g in groups:
        total = dense_group_gradient(g, grads)
        if len(g.leaves) == 1:
            assert total is grads[g.id]  # a group of one: the same object (C4)
            continue
        expected = grads[g.leaves[0]]
        for leaf in g.leaves[1:]:
            expected = expected + grads[leaf]
        np.testing.assert_array_equal(total, expected)


@settings(max_examples=30, deadline=None)
@given(use_orders())
def test_session_sgd_step_matches_brute_force_over_random_use_orders(case):  # C3, C4
    owner, frozen, shapes, extra_flags, uses, seed = case
    rng = np.random.default_rng(seed)
    pl = build(owner, frozen, shapes)
    handles = list(pl) + [Handle((2,), not f) for f in extra_flags]
    for h in handles:
        value = rng.standard_normal(h.shape).astype(np.float32)
        h.set_value(value) if isinstance(h, Param) else h.set(value)
    s = EagerSession()
    refs = [s.use(handles[u]) for u in uses]
    weights = [rng.standard_normal(r.shape).astype(np.float32) for r in refs]
    terms = [(r * w).sum() for r, w in zip(refs, weights) if r.requires_grad]
    if not terms:
        return
    loss = terms[0]
    for t in terms[1:]:
        loss = loss + t
    grads = s.backward(loss, retain_graph=True)
    current = {}
    for u, r, w in zip(uses, refs, weights):
        if not r.requires_grad:
            continue
        h = handles[u]
        key = ("storage", id(h.storage)) if isinstance(h, Param) else ("handle", id(h), r.id)
        current[key] = w if key not in current else current[key] + w
    before = {id(h.storage): h.value.copy() for h in pl}
    before_handles = {id(h): h.v.copy() for h in handles if isinstance(h, Handle)}
    s.sgd_step(0.25, grads)
    for h in handles:
        if isinstance(h, Param):
            key = ("storage", id(h.storage))
            start = before[id(h.storage)]
            want = start - np.float32(0.25) * current[key] if key in current else start
            np.testing.assert_array_equal(h.value, want)
        else:
            want = before_handles[id(h)]
            for key, g in current.items():
                if key[:2] == ("handle", id(h)):
                    want = want - np.float32(0.25) * g
            np.testing.assert_array_equal(h.v, want)
