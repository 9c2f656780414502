// @ts-check
// The host of a page written by dpa_widgets.save_html: the widget's own bundle (its _esm, in the page as text)
// rendered into the page with the saved traits, and no kernel. It stands in for a notebook's widget manager
// (which is megabytes of JavaScript) with the few calls the view makes: get, set and save_changes (a
// selection), on and off (change events), send (it throws: no kernel, and the view is static at once).
// A plain ES module with no imports; export.py puts it in the page's <script type="module">.

const read = (/** @type {string} */ id) => /** @type {HTMLElement} */ (document.getElementById(id)).textContent ?? "";
/** @type {Record<string, any>} */
const state = JSON.parse(read("dpa-state"));
/** @type {Map<string, Function[]>} */
const handlers = new Map();
const model = {
  get: (/** @type {string} */ name) => state[name],
  set(/** @type {string} */ name, /** @type {any} */ value) {
    const before = state[name];
    state[name] = value;
    if (before !== value) for (const f of handlers.get(`change:${name}`) ?? []) f();
  },
  on(/** @type {string} */ event, /** @type {Function} */ f) {
    handlers.set(event, [...(handlers.get(event) ?? []), f]);
  },
  off(/** @type {string} */ event, /** @type {Function} */ f) {
    handlers.set(event, (handlers.get(event) ?? []).filter((g) => g !== f));
  },
  save_changes() {},
  send() {
    throw new Error("a saved page has no kernel");  // the view goes static at once (no "connecting…")
  },
};

const url = URL.createObjectURL(new Blob([read("dpa-esm")], { type: "text/javascript" }));
try {
  const widget = (await import(url)).default;
  await widget.initialize?.({ model });
  await widget.render({ model, el: /** @type {HTMLElement} */ (document.getElementById("dpa-view")) });
} finally {
  URL.revokeObjectURL(url);
}
