"""``python -m dpa selftest``: check dpa on the devices this machine has, CUDA included.

The test suite proves every rule against torch.autograd on the CPU, in float64 (book: modified-backward). A user
with another device -- a GPU, another CPU -- wants to know that dpa is right *there*. This command runs, on each
device (CPU, and every CUDA / MPS device torch sees, or those named with ``--device``):

* on a tiny random model of every family: the forward oracle (the target dpa attributes is the model's own
  logit), completeness (with conservative weights the token scores sum to the target), the component sums
  (edges add up to heads, position-level neurons to neurons), lean memory equal to full, a padded batch
  equal to each prompt alone, and a generation's steps equal to one-position calls; on a device other than the
  CPU, every score equal to the CPU's (the CPU being the one the suite checks against autograd);
* on the default model (unless ``--no-model``): one attribution of a known fact, and the cost of a DPA call
  against a forward + autograd gradient on the same prompt (interleaved, after a warm-up, median of repeats).

It prints one line per check with its largest relative error and the tolerance, and exits with 1 if any fails.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .tiny import FAMILIES as ATTENTION_FAMILIES
from .tiny import HYBRID_FAMILIES, PARALLEL_FAMILIES, random_ids, tiny_model

FAMILIES = ATTENTION_FAMILIES + HYBRID_FAMILIES + PARALLEL_FAMILIES

CONSERVATIVE = dict(query=0.0, key=0.0, value=1.0, gate=0.5, up=0.5)


@dataclass
class Check:
    device: str
    what: str
    error: float  # the largest relative error found
    tolerance: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance  # False for NaN too

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        return f"{mark} {self.device:<7} {self.what:<58} {self.error:9.1e} (tolerance {self.tolerance:.0e}){self.note}"


def devices() -> list[str]:
    """The CPU and every accelerator torch sees."""
    out = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    return out + (["mps"] if mps is not None and mps.is_available() else [])


def relative(a, b) -> float:
    """max |a - b| / max(1, max |b|), on the CPU in float64 (tensors or floats)."""
    a, b = (torch.as_tensor(x).detach().double().cpu() for x in (a, b))
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / max(1.0, float(b.abs().max()))) if a.numel() else 0.0


def _scores(res) -> list:
    return [res.token_scores, res.head_scores, res.neuron_scores, torch.tensor(res.target_logit)]


def check_family(family: str, device: str, reference: dict) -> list[Check]:
    """The identities on one tiny model of ``family`` on ``device``; ``reference`` holds the CPU's results."""
    import dpa

    dtype = torch.float32 if device == "mps" else torch.float64  # MPS has no float64
    tol = 1e-4 if dtype == torch.float32 else 1e-6  # HF's norms round to float32 even in a float64 model
    model = tiny_model(family, dtype=dtype).to(device)
    ids, other = random_ids(11), random_ids(8, seed=2)  # padding shorter than the sliding windows (5)
    target = 5
    res = dpa.attribute(model, None, ids, target=target, edges=True, neuron_positions=True)
    with torch.no_grad():
        logits = model(ids[None].to(device)).logits[0, -1, target]
    told = res.target.capped_logit if res.target.capped_logit is not None else res.target_logit
    experts = dict(router=0.0, expert=1.0) if dpa.spec_for(model).n_experts else {}
    conservative = dpa.PathWeights(**CONSERVATIVE, **experts)
    cons = dpa.attribute(model, None, ids, target=target, weights=conservative)
    lean = dpa.attribute(model, None, ids, target=target, memory="lean")
    full = dpa.attribute(model, None, ids, target=target, memory="full")
    batch = dpa.attribute(model, None, [ids, other], target=target)
    alone = [full, dpa.attribute(model, None, other, target=target)]
    follow = [7, 9, 11]  # a given continuation: one forward, one backward per token, each = its one-position call
    gen = dpa.attribute_generation(model, None, ids, follow)
    steps = [dpa.attribute(model, None, ids.tolist() + follow[:j], target=t) for j, t in enumerate(follow)]
    name = f"{family}:"
    checks = [
        Check(device, f"{name} forward oracle (target = the model's logit)", relative(told, logits), tol),
        Check(device, f"{name} completeness (conservative weights)",
              abs(cons.completeness_gap) / max(1.0, abs(cons.target_logit)), tol),
        Check(device, f"{name} edges sum to heads", relative(res.edge_scores.sum((2, 3)), res.head_scores), tol),
        Check(device, f"{name} position-level neurons sum to neurons",
              relative(res.neuron_position_scores.sum(1), res.neuron_scores), tol),
        Check(device, f"{name} lean memory = full", max(relative(a, b) for a, b in zip(_scores(lean), _scores(full))),
              tol),
        Check(device, f"{name} padded batch = each prompt alone",
              max(relative(a, b) for r, s in zip(batch, alone) for a, b in zip(_scores(r), _scores(s))), tol),
        Check(device, f"{name} a generation's steps = one-position calls",
              max(relative(a, b) for g, s in zip(gen.steps, steps) for a, b in zip(_scores(g), _scores(s))), tol),
    ]
    if device == "cpu":
        reference[family] = _scores(full)
    else:  # the CPU's float64 scores, at this device's tolerance (float32 on MPS)
        checks.append(Check(device, f"{name} every score = the CPU's",
                            max(relative(a, b) for a, b in zip(_scores(full), reference[family])), tol))
    return checks


def check_real_model(device: str, repeats: int = 5) -> tuple[list[Check], str]:
    """One attribution on the default model, and DPA's time over a gradient's (interleaved, warmed up)."""
    import dpa
    from .baselines.gradient import gradient

    model, tok = dpa.load_model(device=device)
    prompt = "The Eiffel Tower is located in the city of"
    res = dpa.attribute(model, tok, prompt, target=" Paris")
    checks = [Check(device, "default model: p(' Paris') > 0.5 and every score finite",
                    0.0 if res.target.probability > 0.5 and all(torch.isfinite(s).all() for s in _scores(res))
                    else float("inf"), 0.0, f"  p = {res.target.probability:.3f}")]
    text = " ".join([prompt] * 8)  # about 80 tokens

    def timed(fn) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    calls = {"dpa": lambda: dpa.attribute(model, tok, text, target=" Paris"),
             "gradient": lambda: gradient(model, tok, text, target=" Paris")}
    for fn in calls.values():  # warm-up at the measured length
        fn()
    times = {k: [] for k in calls}
    for _ in range(repeats):
        for k, fn in calls.items():
            times[k].append(timed(fn))
    ratios = [d / g for d, g in zip(times["dpa"], times["gradient"])]
    n = len(tok(text)["input_ids"])
    cost = (f"{device}: DPA {statistics.median(times['dpa']):.3f} s, forward + gradient "
            f"{statistics.median(times['gradient']):.3f} s on {n} tokens: DPA / gradient = "
            f"{statistics.median(ratios):.2f} (median of {repeats} interleaved pairs, after a warm-up)")
    return checks, cost


def run(device_names: list[str] | None = None, families: list[str] | None = None, model: bool = True,
        say=print) -> bool:
    """Run the checks; True when all pass."""
    from .errors import InputError

    names = []
    for name in device_names or devices():
        try:
            device = torch.device(name)
            if device.type == "meta":
                raise ValueError("the meta device holds no values")
            torch.empty(1, device=device)
        except Exception as err:  # noqa: BLE001 -- any failure to reach the device is the user's to see
            raise InputError(f"--device {name}: torch cannot use it here ({type(err).__name__}: {err})") from None
        # one CPU (cpu:0 is the CPU), each accelerator once: the CPU's results are what the others are compared with
        device = "cpu" if device.type == "cpu" else str(device)
        if device not in names:
            names.append(device)
    names = ["cpu", *[n for n in names if n != "cpu"]]
    chosen = list(dict.fromkeys(families or FAMILIES))
    unknown = sorted(set(chosen) - set(FAMILIES))
    if unknown:
        raise InputError(f"--families: unknown {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    say(f"dpa selftest: torch {torch.__version__}, devices {', '.join(names)}, {len(chosen)} families")
    reference: dict = {}
    results, costs = [], []
    for device in names:
        for family in chosen:
            for check in check_family(family, device, reference):
                results.append(check)
                say(check.line())
        if model:
            checks, cost = check_real_model(device)
            for check in checks:
                results.append(check)
                say(check.line())
            costs.append(cost)
    for cost in costs:
        say("cost   " + cost)
    failed = [c for c in results if not c.ok]
    say(f"{len(results) - len(failed)} of {len(results)} checks passed" + (f"; FAILED: {len(failed)}" if failed else ""))
    return not failed
