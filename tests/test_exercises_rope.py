"""Chapter rope's exercises: the mistakes learners make, written as a learner would, each failing with its hint (the
reference solutions are the book's own, tests/test_exercises.py)."""

from __future__ import annotations

import pytest
import torch

from dpa.exercises import check


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")


# x = (1, 2, 3, 4), a = (1, 0, 0, 1), cos = (0.6, 0, 0.6, 0), sin = (0.8, 1, 0.8, 1): R x = (-1.8, -4, 2.6, 2),
# R^T a = (0.6, 1, -0.8, 0)
@pytest.mark.parametrize("answer, hint", [
    (([-1.8, -4, 2.6, 2], [0.6, -1, 0.8, 0]), "R_m^T a is rotated the wrong way"),  # R a
    (([3.0, 4, 1, -2], [0.6, 1, -0.8, 0]), "R_m x is rotated the wrong way"),  # rotate_half as [x2, -x1]
    (([-1.0, 2, -4, 3], [0.6, 1, -0.8, 0]), "R_m x pairs neighbouring coordinates"),  # (x0, x1), (x2, x3)
    (([-1.8, -4, 2.6, 2], [0.6, -0.8, 1, 0]), "R_m^T a pairs neighbouring coordinates"),
])
def test_rope_by_hand_mistakes(answer, hint):
    verdict = check.rope_by_hand(answer)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_flipped(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)  # the sign on the wrong half


def adjacent_pairs(a, cos, sin):
    half = a.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = a[..., 0::2], a[..., 1::2]
    return torch.stack([even * c + odd * s, odd * c - even * s], -1).flatten(-2)  # rotated back, pair by pair


@pytest.mark.parametrize("fn, hint", [
    (lambda a, cos, sin: a * cos + rotate_half(a) * sin, "rotated the wrong way"),  # R a, the forward rotation
    (lambda a, cos, sin: a * cos - rotate_half_flipped(a * sin), "rotated the wrong way"),
    (lambda a, cos, sin: a, "rotation is missing"),
    (adjacent_pairs, "neighbouring coordinates are paired"),
    (lambda a, cos, sin: a * sin - rotate_half(a * cos), "cos and sin are swapped"),
])
def test_rope_transpose_mistakes(fn, hint):
    verdict = check.rope_transpose(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def back(a, cos, sin):
    return a * cos - rotate_half(a * sin)


def join(y):
    return y.transpose(0, 1).flatten(1)


def paths(delta, q_hat, k_hat, cos, sin, W_Q, W_K, pull=back, scale=True, expand="interleave", group="sum",
          key_index="j"):
    H, H_kv, D_h = q_hat.shape[0], k_hat.shape[0], q_hat.shape[-1]
    G = H // H_kv
    a = D_h**-0.5 if scale else 1.0
    k_of_head = k_hat.repeat_interleave(G, dim=0) if expand == "interleave" else k_hat.repeat(G, 1, 1)
    per_head = (delta.transpose(-1, -2) if key_index == "j" else delta) @ q_hat * a
    if group == "sum":
        g_k = per_head.unflatten(0, (H_kv, G)).sum(1)
    elif group == "mean":
        g_k = per_head.unflatten(0, (H_kv, G)).mean(1)
    elif group == "first":
        g_k = per_head[::G]
    else:  # heads h and h + H_kv share a KV head
        g_k = per_head.unflatten(0, (G, H_kv)).sum(0)
    return join(pull(delta @ k_of_head * a, cos, sin)) @ W_Q, join(pull(g_k, cos, sin)) @ W_K


def forward_rope(a, cos, sin):
    return a * cos + rotate_half(a) * sin


def right_q_wrong_k(delta, q_hat, k_hat, cos, sin, W_Q, W_K):
    return paths(delta, q_hat, k_hat, cos, sin, W_Q, W_K)[0], paths(delta, q_hat, k_hat, cos, sin, W_Q, W_K,
                                                                     pull=forward_rope)[1]


@pytest.mark.parametrize("kw, hint", [
    (dict(pull=forward_rope), "pull-back rotates the wrong way"),
    (dict(pull=lambda y, cos, sin: y), "rotation is missing"),
    (dict(scale=False), "1/sqrt(D_h) is missing"),
    (dict(expand="tile"), "h mod H_kv (torch's repeat)"),
    (dict(group="mod"), "group of a KV head is taken as h mod H_kv"),
    (dict(group="mean"), "averages the targets of a group"),
    (dict(group="first"), "only the first query head"),
    (dict(key_index="i"), "g_K sums over the wrong index"),
])
def test_rope_gqa_query_key_mistakes(kw, hint):
    verdict = check.rope_gqa_query_key(lambda *args: paths(*args, **kw))
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def test_rope_gqa_query_key_one_path_rotated_the_wrong_way():
    verdict = check.rope_gqa_query_key(right_q_wrong_k)
    assert verdict.status == "wrong" and "g_K rotates the wrong way" in verdict.message, verdict.message


def grouped_as_g_by_h_kv(delta, q_hat, k_hat, cos, sin, W_Q, W_K):
    """The KV heads' targets added up over a [G, H_kv] view: right only where G = H_kv."""
    H, H_kv, D_h = q_hat.shape[0], k_hat.shape[0], q_hat.shape[-1]
    G = H // H_kv
    g_k = (delta.transpose(-1, -2) @ q_hat / D_h**0.5).unflatten(0, (G, H_kv)).sum(1)
    return paths(delta, q_hat, k_hat, cos, sin, W_Q, W_K)[0], join(back(g_k, cos, sin)) @ W_K


def scaled_by_the_group(delta, q_hat, k_hat, cos, sin, W_Q, W_K):
    """1/G in place of 1/sqrt(D_h): right only where G = sqrt(D_h)."""
    G, D_h = q_hat.shape[0] // k_hat.shape[0], q_hat.shape[-1]
    g_q, g_k = paths(delta, q_hat, k_hat, cos, sin, W_Q, W_K)
    return g_q * D_h**0.5 / G, g_k * D_h**0.5 / G


@pytest.mark.parametrize("fn", [grouped_as_g_by_h_kv, scaled_by_the_group])
def test_rope_gqa_query_key_cases_leave_no_coincidence(fn):
    """The cases have G != H_kv and sqrt(D_h) != G, H_kv: an answer right only when they coincide fails."""
    assert check.rope_gqa_query_key(fn).status == "wrong"
