// @ts-check
// The token strip: coloured by input scores, or by the selected unit's per-position scores.
import { h, legend, pressable } from "./dom.js";
import { symmetricMax, divergingColor, textColor, formatScore, tokenLabel, neuronLabel, expertLabel, headLabel, unitKind } from "./helpers.js";
/** @typedef {import("./context.js").Ctx} Ctx */

/** The scores the token strip shows now, and what they are. @param {Ctx} ctx */
export function stripScores(ctx) {
  const data = ctx.get("_data");
  const s = ctx.sel();
  if (s.head) {
    const d = ctx.detail(`head:${s.head[0]}:${s.head[1]}`);
    if (d && d.by_key) return { scores: d.by_key, caption: `tokens coloured by ${unitKind(data, s.head[0], s.head[1])} ${headLabel(data, s.head[0], s.head[1])} (its edges from each key)` };
  }
  if (s.neuron) {
    const d = ctx.detail(`neuron:${s.neuron[0]}:${s.neuron[1]}`);
    if (d && d.by_pos) return { scores: d.by_pos, caption: `tokens coloured by neuron ${neuronLabel(data, s.neuron[0], s.neuron[1])} (its contribution at each position)` };
  }
  if (s.expert) {
    const d = ctx.detail(`expert:${s.expert[0]}:${s.expert[1]}`);
    if (d && d.by_pos) return { scores: d.by_pos, caption: `tokens coloured by expert ${expertLabel(data, s.expert[0], s.expert[1])} (its contribution at each position)` };
  }
  const cmp = ctx.get("_comparison") || {};
  if (cmp.level === "input" && cmp.token_scores) return { scores: cmp.token_scores, caption: `input scores · ${cmp.method}` };
  return { scores: data.token_scores, caption: `input scores · ${data.method}` };
}

/** @param {Ctx} ctx */
export function tokensView(ctx) {
  const data = ctx.get("_data");
  const { scores, caption } = stripScores(ctx);
  const max = symmetricMax(scores, data.special);
  const s = ctx.sel();
  const strip = h("div", { class: "dpa-tokens", role: "list", "data-scroll": "tokens" });
  /** @type {Map<number, string>} the positions holding a target's own tokens (and a contrast's): teacher forcing */
  const forced = new Map();
  for (const side of [false, true]) {
    (data.target.terms || []).filter((x) => !!x.contrast === side).slice(1)
      .forEach((x) => forced.set(x.position, side ? "contrast" : "target"));
  }
  data.tokens.forEach((tok, i) => {
    const v = scores[i];
    const chip = h("span", {
      class: "dpa-token" + (data.special[i] ? " dpa-special" : "") + (s.token === i ? " dpa-locked" : "") +
        (i === data.target.position ? " dpa-target-pos" : "") + (forced.has(i) ? " dpa-forced" : ""),
      role: "listitem", "data-pos": i,
      title: `${i}: ${JSON.stringify(tok)}  ${formatScore(v)}` + (forced.has(i) ? `  (${forced.get(i)}, teacher-forced)` : ""),
      style: `background:${divergingColor(v, max)};color:${textColor(v, max)}`, text: tokenLabel(tok),
    });
    chip.addEventListener("mouseenter", () => ctx.setHover(`token ${i} ${JSON.stringify(tok)}: ${formatScore(v)}`));
    pressable(chip, `token:${i}`, () => ctx.setTrait("selected_token", s.token === i ? null : i));
    chip.setAttribute("aria-label", `token ${i} ${JSON.stringify(tok)}, score ${formatScore(v)}`);
    strip.append(chip);
  });
  return h("section", { class: "dpa-panel dpa-tokens-panel" }, [
    h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: caption }), legend(max, "")]),
    strip,
  ]);
}
