// @ts-check
// DOM helpers: element factory, downloads, the colour legend.
import { DIVERGING, formatScore } from "./helpers.js";

/**
 * @param {string} tag
 * @param {Record<string, any>} [attrs]
 * @param {(Node | string)[]} [children]
 */
export function h(tag, attrs = {}, children = []) {
  const svg = ["svg", "rect", "text", "g", "line", "title"].includes(tag);
  const node = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = String(v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children) node.append(c);
  return node;
}

/**
 * Make ``el`` work from the keyboard like a button: in the Tab order, Enter or space does what a click does.
 * ``key`` names it for the redraw, which puts the focus back on the element of the same key.
 * @param {Element} el @param {string} key @param {() => void} action
 */
export function pressable(el, key, action) {
  el.setAttribute("tabindex", "0");
  el.setAttribute("data-focus", key);
  el.addEventListener("click", action);
  el.addEventListener("keydown", (/** @type {Event} */ ev) => {
    const k = /** @type {KeyboardEvent} */ (ev).key;
    if (k === "Enter" || k === " ") { ev.preventDefault(); action(); }
  });
  return el;
}

/**
 * A cursor over a drawing's cells for the keyboard: ``el`` joins the Tab order (``key`` names it for the
 * redraw); an arrow key calls ``move`` (true: the cursor moved, and ``mark`` shows it), Enter or space ``act``;
 * focusing ``el`` shows the cursor.
 * @param {Element} el @param {string} key @param {string} label
 * @param {{move: (arrow: string) => boolean, mark: () => void, act: () => void}} cursor
 */
export function arrowCursor(el, key, label, { move, mark, act }) {
  el.setAttribute("tabindex", "0");
  el.setAttribute("data-focus", key);
  el.setAttribute("aria-label", label);
  el.addEventListener("keydown", (/** @type {Event} */ ev) => {
    const k = /** @type {KeyboardEvent} */ (ev).key;
    if (k === "Enter" || k === " ") act();
    else if (k.startsWith("Arrow") && move(k)) mark();
    else return;
    ev.preventDefault();
  });
  el.addEventListener("focus", mark);
}

/** @param {string} name @param {string} text @param {string} type */
export function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = h("a", { href: url, download: name });
  document.body.append(a);
  /** @type {HTMLAnchorElement} */ (a).click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

/** @param {string} svg @param {string} name */
export function downloadPng(svg, name) {
  const img = new Image();
  img.onload = () => {
    const canvas = document.createElement("canvas");
    canvas.width = img.width * 2;
    canvas.height = img.height * 2;
    const ctx = /** @type {CanvasRenderingContext2D} */ (canvas.getContext("2d"));
    ctx.scale(2, 2);
    ctx.drawImage(img, 0, 0);
    canvas.toBlob((blob) => {
      if (!blob) return;
      const url = URL.createObjectURL(blob);
      const a = h("a", { href: url, download: name });
      document.body.append(a);
      /** @type {HTMLAnchorElement} */ (a).click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 1000);
    }, "image/png");
  };
  img.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(svg);
}

/** A gradient legend: -max ... 0 ... +max. @param {number} max @param {string} label */
export function legend(max, label) {
  const stops = DIVERGING.map((c, i) => `rgb(${c.join(",")}) ${(i / (DIVERGING.length - 1) * 100).toFixed(0)}%`);
  return h("div", { class: "dpa-legend", title: "symmetric scale, white at zero" }, [
    h("span", { class: "dpa-legend-label", text: label }),
    h("span", { class: "dpa-legend-num", text: formatScore(-max) }),
    h("span", { class: "dpa-legend-bar", style: `background: linear-gradient(to right, ${stops.join(", ")})` }),
    h("span", { class: "dpa-legend-num", text: formatScore(max) }),
  ]);
}
