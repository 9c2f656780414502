"""Circuit discovery on a user's own clean/counterfactual pairs: read them, score every edge, evaluate MIB's
faithfulness, export the EAP-IG Graph JSON (``dpa mib``; the book: circuit-discovery).

A pairs file has one JSON object a line::

    {"clean": "When Mary and John went to the store, John gave a drink to",
     "counterfactual": "When Mary and John went to the store, Anne gave a drink to",
     "answer": " Mary", "counterfactual_answer": " John"}

(``answers`` / ``counterfactual_answers``, lists of tokens, for the probability difference instead of the logit
difference). Prompts are encoded as every dpa entry point encodes them; a line that is not such an object, whose
prompts differ in length, or whose answer is not one token is refused by its line number.

With ``out`` the run is kept in a folder, batch by batch, and a run started again there goes on from where it
stopped (the same pairs, model and settings, the model known by its weights, config, buffers and dtype as every dpa
run folder knows it; anything else is refused, and so is a second run writing the folder at once). Every batch file
is stamped with its run, stage and pairs: one copied in from another run is refused by name. A finished folder holds
``graph.json`` (the EAP-IG JSON), ``faithfulness.json`` and ``per_pair.pt`` (every pair's metric at every size);
``load`` reads it back without the model and without writing or locking anything (a read-only copy reads too).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import DPAError, InputError, InputTypeError, NonFiniteError
from ..weights import PathWeights
from .evaluate import SIZES, Faithfulness, Plan, check_size, check_sizes, save_whole
from .forward import batch_of
from .graph import Graph
from .methods import METHODS, Method, batch_scores, check_method
from .pairs import Pairs

KEYS = ("clean", "counterfactual")
SINGLE = ("answer", "counterfactual_answer")
LISTS = ("answers", "counterfactual_answers")


def read_pairs(path: str | os.PathLike, tokenizer, *, vocab_size: int | None = None) -> Pairs:
    """The pairs of a JSON-lines file (module docstring); errors name the line."""
    from ..files import load_json, read_text, split_lines
    from ..request import encode_prompt
    from ..targets import token_id

    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(f"the pairs file must be a path (a str or os.PathLike), got {type(path).__name__}")
    path = Path(path)
    lines = split_lines(read_text(path, "pairs file"))  # dpa's one text reader: UTF-8 (a BOM dropped), not empty
    vocab = vocab_size or len(tokenizer)
    clean, counter, answers, wrong, names, kinds = [], [], [], [], [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name} line {n}"
        row = load_json(line, where)  # dpa's one JSON reader: a key twice in an object is refused
        if not isinstance(row, dict):
            raise InputError(f"{where}: a pair is a JSON object with {', '.join(KEYS)} and answers")
        unknown = sorted(set(row) - set(KEYS) - set(SINGLE) - set(LISTS))
        if unknown:
            raise InputError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a pair has "
                             f"{', '.join(KEYS + SINGLE)} (or the lists {', '.join(LISTS)})")
        missing = [k for k in KEYS if not isinstance(row.get(k), str) or not row.get(k)]
        if missing:
            raise InputError(f"{where}: {missing[0]!r} is missing or not a non-empty string")
        single = any(k in row for k in SINGLE)
        if single and any(k in row for k in LISTS):
            raise InputError(f"{where}: give 'answer' and 'counterfactual_answer' or the lists 'answers' and "
                             "'counterfactual_answers', not both")
        good = [row.get("answer")] if single else row.get("answers")
        bad = [row.get("counterfactual_answer")] if single else row.get("counterfactual_answers")
        if not isinstance(good, list) or not isinstance(bad, list) or not good or not bad or None in good + bad:
            raise InputError(f"{where}: give 'answer' and 'counterfactual_answer' (or the lists 'answers' and "
                             "'counterfactual_answers')")
        kinds.add("logit_diff" if single else "prob_diff")
        try:
            a = [token_id(tokenizer, t, vocab, what="answer", options=("error",)) for t in good]
            b = [token_id(tokenizer, t, vocab, what="counterfactual answer", options=("error",)) for t in bad]
            ids = encode_prompt(tokenizer, row["clean"]), encode_prompt(tokenizer, row["counterfactual"])
        except DPAError as err:  # a target error says how to attribute a first token, which MIB's metric cannot
            raise InputError(f"{where}: {str(err).split('. Pass one of')[0]}") from None
        if len(ids[0]) != len(ids[1]):
            raise InputError(f"{where}: the clean prompt is {len(ids[0])} tokens and the counterfactual "
                             f"{len(ids[1])}; MIB patches position by position, so they must be as long")
        clean.append(ids[0]), counter.append(ids[1]), answers.append(a), wrong.append(b), names.append(where)
    if not clean:
        raise InputError(f"{path}: no pairs in the file")
    if len(kinds) > 1:
        raise InputError(f"{path}: some lines give one answer and some lists of answers; one metric per file")
    return Pairs(clean, counter, answers, wrong, kinds.pop(), names)


@dataclass
class Discovery:
    """Edge scores on MIB's graph [writer reader], how they were made, and (``evaluate``) their faithfulness."""

    graph: Graph
    scores: Tensor
    method: str
    faithfulness: Faithfulness | None
    d_model: int = 0
    made_on: dict | None = None  # the model's fingerprints and the pairs' digest (``made_on``), where known

    def check_made_on(self, model: nn.Module, pairs: Pairs) -> None:
        """Refuse a model or pairs that are not the ones these scores were made on (where that is known): f
        evaluated on them would be drawn beside the discovery's own as if it were the same run."""
        if not self.made_on:
            return
        now = made_on(model, pairs)
        differ = [k for k in self.made_on if k in now and now[k] != self.made_on[k]]
        if differ:
            what = "pairs" if differ == ["pairs"] else "model" if "pairs" not in differ else "model and pairs"
            raise InputError(f"these are not the {what} the discovery was made on ({', '.join(differ)} differ): f at "
                             "other sizes would not be the discovery's; pass its own model and pairs")

    def circuit(self, size: float, absolute: bool = False) -> Tensor:
        """The circuit of the top ``size`` share of edges (pruned, as MIB evaluates it) [writer reader] bool."""
        from ..checks import check_bool

        size = check_size(size)
        return self.graph.top(self.scores, int(size * self.graph.n_edges), check_bool("absolute", absolute))

    def edges(self, size: float, absolute: bool = False) -> list[tuple[str, float]]:
        """The circuit's edges by name with their scores, best first."""
        kept = self.circuit(size, absolute)
        pairs = [(self.graph.edge_name(w, r), float(self.scores[w, r])) for w, r in kept.nonzero().tolist()]
        return sorted(pairs, key=lambda p: -abs(p[1]) if absolute else -p[1])

    def to_json(self, size: float | None = None, absolute: bool = False) -> dict:
        """The EAP-IG Graph JSON (what MIB's leaderboard reads): every edge's score; with ``size``, the circuit."""
        kept = None if size is None else self.circuit(size, absolute)
        return self.graph.to_json(self.scores, kept, self.d_model)

    def save_json(self, path, size: float | None = None, absolute: bool = False) -> None:
        _write_text(path, json.dumps(self.to_json(size, absolute)))

    def summary(self) -> str:
        lines = [f"{self.method} edge scores on MIB's graph: {self.graph.n_edges} edges "
                 f"({self.graph.n_layers} layers x {self.graph.n_heads} units: attention heads, or a token "
                 "mixer's units)"]
        if self.faithfulness is not None:
            f = self.faithfulness
            lines.append(f"CPR {f.cpr:.3f} (higher is better)   CMD {f.cmd:.3f} (lower is better)")
            lines.append("size   f (signed)  edges   f (|score|)  edges")  # each ranking keeps its own circuit
            for k, p in enumerate(f.cpr_curve.sizes):
                lines.append(f"{p:<6g} {float(f.cpr_curve.f[k]):>9.3f} {f.cpr_curve.kept[k]:>7}   "
                             f"{float(f.cmd_curve.f[k]):>10.3f} {f.cmd_curve.kept[k]:>6}")
        return "\n".join(lines)

    def plot(self, ax=None):
        """f over the circuit size for both rankings (matplotlib ``Axes``)."""
        import matplotlib.pyplot as plt

        if self.faithfulness is None:
            raise InputError("this discovery was not evaluated (evaluate=True)")
        if ax is None:
            _, ax = plt.subplots(figsize=(5, 3.2))
        f = self.faithfulness
        for curve, label in ((f.cpr_curve, f"signed (CPR {f.cpr:.2f})"), (f.cmd_curve, f"|score| (CMD {f.cmd:.2f})")):
            ax.plot(curve.sizes, curve.f.numpy(), marker="o", label=label)
        ax.axhline(1, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("share of edges kept (the areas CPR, CMD: on a linear axis)")
        ax.set_ylabel("faithfulness f")
        ax.set_title(self.method)
        ax.legend(frameon=False)
        return ax


def discover(model: nn.Module, tokenizer, pairs: Pairs | str | os.PathLike, *, method: Method = "dpa-cf",
             weights: PathWeights | None = None, temperature: float | None = None, evaluate: bool = True,
             sizes=SIZES, batch_size: int = 8, out: str | os.PathLike | None = None,
             progress: bool = True) -> Discovery:
    """Score every edge of MIB's graph on the pairs (a ``Pairs`` or a pairs file) with ``method`` (see
    ``dpa.mib.edge_scores``) and, with ``evaluate``, measure the circuits' faithfulness (CPR, CMD). With ``out``, a
    folder keeps every batch as it is done; called again with the same folder, the run goes on where it stopped."""
    from ..checks import check_bool, check_int
    from ..request import check_model
    from .forward import check_graph_run

    spec = check_model(model)
    check_graph_run(model, spec)
    batch_size = check_int("batch_size", batch_size, low=1)
    evaluate, progress = check_bool("evaluate", evaluate), check_bool("progress", progress)
    sizes = check_sizes(sizes, areas=evaluate)
    method = check_method(method, weights, temperature)
    if not isinstance(pairs, Pairs):
        if not isinstance(pairs, (str, os.PathLike)):
            raise InputTypeError(f"pairs must be a dpa.mib.Pairs or a pairs file's path, got {type(pairs).__name__}")
        pairs = read_pairs(pairs, tokenizer, vocab_size=spec.vocab_size)
    pairs.check(spec)
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise InputTypeError(f"out must be a folder (a str or path), got {type(out).__name__}")
    graph = Graph.of(spec)
    if out is None:
        return _discover(model, pairs, method, weights, temperature, evaluate, sizes, batch_size, graph, spec, None,
                         progress)
    from .. import locks
    from ..files import run_folder

    folder = run_folder(out, marker="run.json")
    identity = _identity(model, spec, pairs, method, weights, temperature, sizes, batch_size)
    store = _Store(folder, identity, graph)
    with locks.hold(folder, then=store.open):  # one run writes a folder at a time, and only the run it holds
        return _discover(model, pairs, method, weights, temperature, evaluate, sizes, batch_size, graph, spec, store,
                         progress)


def _discover(model, pairs, method, weights, temperature, evaluate, sizes, batch_size, graph, spec, store,
              progress) -> Discovery:
    rows = list(range(len(pairs)))
    plan_rows = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    bar = _bar(progress, 2 * len(pairs) if evaluate else len(pairs), f"{method} edges")
    try:
        total = torch.zeros(graph.exists.shape, dtype=torch.float64)
        if method == "random":  # no batches: one draw for the whole graph
            from .methods import edge_scores

            total = edge_scores(model, pairs, "random")
            bar.update(len(pairs))
        for b, chunk in enumerate(plan_rows if method != "random" else []):
            part = store.get("scores", b, chunk) if store else None
            if part is None:
                part = _scores(model, pairs, chunk, method, weights, temperature, graph, batch_size)
                if not bool(torch.isfinite(part).all()):
                    raise NonFiniteError(f"{method} edge scores of the pairs {_named(pairs, chunk)} are not finite "
                                         "(NaN or infinite: the model's activations or gradients overflow, or hold "
                                         "NaN, on them); no circuit can be ranked")
                if store:
                    store.put("scores", b, chunk, part)
            total += part
            bar.update(len(chunk))
        scores = total * graph.exists
        result = None
        if evaluate:
            bar.set_description("faithfulness")
            plan = Plan.of(graph, scores, sizes)
            done = []
            for b, chunk in enumerate(plan_rows):
                m = store.get("metrics", b, chunk, len(plan.circuits)) if store else None
                if m is None:
                    with batch_of(model, pairs, chunk) as batch:
                        m = plan.metrics(batch)
                    if store:
                        store.put("metrics", b, chunk, m)
                done.append((chunk, m))
                bar.update(len(chunk))
            result = plan.collect(done, len(pairs))
    finally:
        bar.close()
    found = Discovery(graph, scores, method, result, spec.d_model, made_on(model, pairs))
    if store:
        found.save_json(store.folder / "graph.json")
        if result is not None:
            result.save(store.folder / "per_pair.pt")
            _write_text(store.folder / "faithfulness.json", json.dumps(_faithfulness_json(found), indent=1))
    return found


def load(folder: str | os.PathLike) -> Discovery:
    """A finished ``discover(..., out=folder)`` run (or ``dpa mib --out``), read back without the model: the edge
    scores from ``graph.json``, the method from ``run.json``, the faithfulness from ``per_pair.pt`` where the run was
    evaluated. Reads only: no lock is taken and nothing is written, so a read-only copy reads too."""
    from ..files import load_json, read_text

    if not isinstance(folder, (str, os.PathLike)):
        raise InputTypeError(f"folder must be a run folder's path (a str or path), got {type(folder).__name__}")
    folder = Path(folder)
    meta = load_json(read_text(folder / "run.json", "run file"), str(folder / "run.json")) \
        if (folder / "run.json").is_file() else None
    if not isinstance(meta, dict) or not isinstance(meta.get("method"), str):
        raise InputError(f"{folder} is not a dpa mib run folder (no readable run.json naming its method)")
    if not (folder / "graph.json").is_file():
        raise InputError(f"{folder} holds no graph.json: the run did not finish; run it again with the same "
                         "out folder (it goes on where it stopped)")
    data = load_json(read_text(folder / "graph.json", "graph file"), str(folder / "graph.json"))
    graph, scores, _ = Graph.from_json(data)
    if (graph.n_layers, graph.n_heads) != (meta.get("layers"), meta.get("heads")):
        raise InputError(f"{folder}: graph.json is a graph of {graph.n_layers} layers x {graph.n_heads} heads, "
                         f"run.json's model has {meta.get('layers')} x {meta.get('heads')}: not this run's graph")
    result = None
    if (folder / "per_pair.pt").is_file():
        try:
            result = Faithfulness.load(folder / "per_pair.pt")
        except Exception:  # noqa: BLE001 - said by name
            raise InputError(f"{folder / 'per_pair.pt'} is damaged: run the folder again after deleting it") from None
    d_model = data["cfg"].get("d_model", 0)
    from ..files import CONFIG_KEY, STATE_KEY, WEIGHTS_KEY

    known = {k: meta[k] for k in (WEIGHTS_KEY, CONFIG_KEY, STATE_KEY, "pairs") if isinstance(meta.get(k), str)}
    return Discovery(graph, scores, meta["method"], result, d_model if isinstance(d_model, int) else 0, known or None)


def _named(pairs: Pairs, rows: list[int]) -> str:
    names = [pairs.names[i] if pairs.names else str(i) for i in rows]
    return f"{names[0]} .. {names[-1]}" if len(names) > 1 else names[0]


def _scores(model, pairs, chunk, method, weights, temperature, graph, batch_size) -> Tensor:
    from .methods import edge_scores

    if method == "exact":
        return edge_scores(model, pairs.subset(chunk), method, batch_size=batch_size)
    return batch_scores(model, pairs, chunk, method, graph, weights=weights, temperature=temperature)


def _faithfulness_json(found: Discovery) -> dict[str, Any]:
    f = found.faithfulness
    curve = lambda c: {"sizes": list(c.sizes), "edges": c.edges, "kept": c.kept,  # noqa: E731
                       "f": [float(x) for x in c.f]}
    return {"method": found.method, "n_edges": f.n_edges, "cpr": f.cpr, "cmd": f.cmd, "cpr_curve": curve(f.cpr_curve),
            "cmd_curve": curve(f.cmd_curve), "m_full": float(f.cpr_curve.full.mean()),
            "m_empty": float(f.cpr_curve.empty.mean())}


def _digest(pairs: Pairs) -> str:
    return hashlib.sha256(json.dumps([pairs.clean, pairs.counter, pairs.answers, pairs.wrong, pairs.metric])
                          .encode()).hexdigest()


def made_on(model: nn.Module, pairs: Pairs) -> dict:
    """What a discovery was made on: the model's fingerprints (weights, config, state) and the pairs' digest."""
    from ..files import CONFIG_KEY, STATE_KEY, WEIGHTS_KEY, model_identity
    from ..request import check_model

    spec = check_model(model)
    ident = model_identity(model, spec.unembed(model).weight.dtype)
    return {**{k: ident[k] for k in (WEIGHTS_KEY, CONFIG_KEY, STATE_KEY) if k in ident}, "pairs": _digest(pairs)}


def _identity(model, spec, pairs: Pairs, method, weights, temperature, sizes, batch_size) -> dict:
    from ..files import model_identity

    digest = _digest(pairs)
    # the model by its weights, config, buffers and dtype too (dpa's run identity): never resumed on another
    return {**model_identity(model, spec.unembed(model).weight.dtype),
            "model": getattr(model.config, "_name_or_path", "") or spec.family, "family": spec.family,
            "layers": spec.n_layers, "heads": spec.row_width, "pairs": digest, "n_pairs": len(pairs),
            "method": method, "weights": None if weights is None else weights.to_dict(),
            "temperature": temperature, "sizes": list(sizes), "batch_size": batch_size}


class _Store:
    """A run's folder: ``run.json`` (what the run is) and one file per batch and stage, written whole or not at all.
    ``open`` (under the folder's lock) checks ``run.json`` against the run, or writes it; a batch file read back
    must be what its stage writes for that batch (a damaged one is named)."""

    def __init__(self, folder: Path, identity: dict, graph: Graph):
        from ..files import run_id

        self.folder, self.identity, self.graph = folder, identity, graph
        self.run = run_id(identity)  # stamped on every batch file: one of another run is known

    def open(self) -> None:
        from ..files import FINGERPRINTS, WEIGHTS_KEY

        folder, identity = self.folder, self.identity
        meta = folder / "run.json"
        (folder / "batches").mkdir(exist_ok=True)
        if meta.exists():
            try:
                before = json.loads(meta.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                before = None
            if not isinstance(before, dict):
                raise InputError(f"{meta} is damaged: delete the folder {folder} or use another --out")
            # a run.json of a dpa that recorded no model fingerprints: taken as this model's, recorded from now on
            assumed = {k: identity[k] for k in (*FINGERPRINTS, "dtype") if k in identity and k not in before} \
                if WEIGHTS_KEY not in before else {}
            full = {**before, **assumed}
            if full != identity:
                def shown(d: dict, k: str):  # a float32 run records no dtype
                    return d.get(k, "float32") if k == "dtype" else d.get(k)
                diff = sorted(k for k in set(full) | set(identity) if full.get(k) != identity.get(k))
                said = "; ".join(f"{k}: {shown(full, k)!r} there, {shown(identity, k)!r} now" for k in diff[:3])
                raise InputError(f"{folder} holds another run ({said}): use a new --out folder, or delete it")
            if not assumed:
                return
        _write_text(meta, json.dumps(identity, indent=1))

    def _path(self, stage: str, b: int) -> Path:
        return self.folder / "batches" / f"{stage}-{b:05d}.pt"

    def get(self, stage: str, b: int, rows: list[int], circuits: int = 0):
        path = self._path(stage, b)
        if not path.exists():
            return None
        try:
            saved = torch.load(path, weights_only=True)
        except Exception:  # noqa: BLE001 - a damaged file: said by name
            saved = None
        again = "delete it (its batch is run again when the run goes on)"
        if not isinstance(saved, dict) or set(saved) != {"run", "stage", "batch", "rows", "value"}:
            raise InputError(f"{path} is damaged or not a batch file of dpa mib: {again}")
        if (saved["run"], saved["stage"], saved["batch"]) != (self.run, stage, b) or saved["rows"] != list(rows):
            raise InputError(f"{path} is not this run's {stage} of batch {b} (pairs {rows[0]}..{rows[-1]}): it was "
                             f"written by another run or for another batch (copied in?): {again}")
        if not self._whole(stage, saved["value"], len(rows), circuits):
            raise InputError(f"{path} is damaged: {again}")
        return saved["value"]

    def _whole(self, stage: str, value, n: int, circuits: int) -> bool:
        """Whether ``value`` is what ``stage`` writes for a batch of ``n`` pairs: finite edge scores [writer
        reader], or the metrics full and empty [n] and circuits [circuits n]."""
        def tensor(x, shape) -> bool:
            return isinstance(x, Tensor) and x.is_floating_point() and tuple(x.shape) == shape
        if stage == "scores":  # scores are stored only when finite
            return tensor(value, tuple(self.graph.exists.shape)) and bool(torch.isfinite(value).all())
        return (isinstance(value, dict) and set(value) == {"full", "empty", "circuits"}
                and tensor(value["full"], (n,)) and tensor(value["empty"], (n,))
                and tensor(value["circuits"], (circuits, n)))

    def put(self, stage: str, b: int, rows: list[int], value) -> None:
        save_whole(self._path(stage, b), {"run": self.run, "stage": stage, "batch": b, "rows": list(rows),
                                          "value": value})


def _write_text(path: Path, text: str) -> None:
    """dpa's one writer (``dpa.files.write_text``): atomic, a device or FIFO written straight, a folder refused."""
    from ..files import write_text

    write_text(path, text)


def _bar(progress: bool, total: int, what: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="pair", desc=what, disable=not progress, leave=False)


__all__ = ["Discovery", "discover", "load", "read_pairs", "METHODS"]
