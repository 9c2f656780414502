// A small payload in the shape dpa_widgets/payload.py sends (2 layers, 4 heads in 2 KV groups).

/** @returns {import("../../dpa_widgets/static/src/model.js").Payload} */
export function payload() {
  return {
    tokens: ["<s>", " Mary", " and", " John"],
    token_scores: [5, 2, -1, 0.5],
    special: [true, false, false, false],
    target: { kind: "token", position: 3, token: " Mary", token_id: 42, contrast: null, contrast_id: null,
      probability: 0.9, logprob: -0.1 },
    target_logit: 6.5,
    completeness_gap: 0,
    weights: { query: 0.25, key: 0.25, value: 0.5, gate: 0.5, up: 0.5 },
    method: "dpa",
    model_name: "tiny",
    n_layers: 2,
    n_heads: 4,
    n_kv_heads: 2,
    d_mlp: 16,
    head_scores: [[0.1, -0.2, 0.3, 0], [1.5, -0.4, 0.05, 0.2]],
    mlp_totals: [0.4, -0.7],
    neurons: { index: [[7, 3], [1, 9]], score: [[0.5, -0.1], [-2, 0.3]] },
    top_predictions: [[" Mary", 0.9], [" the", 0.05]],
    token_routes: [
      { heads: [[1, 0, 0.9]], neurons: [[0, 7, 0.2]] },
      { heads: [[0, 2, 0.4], [1, 1, -0.3]], neurons: [[1, 1, -0.5]] },
      { heads: [[0, 1, 0.1]], neurons: [[0, 3, 0.1]] },
      { heads: [[1, 3, 0.2]], neurons: [[1, 9, 0.1]] },
    ],
  };
}

/**
 * The same prompt on a mixture-of-experts model (Qwen2-MoE-like): 2 layers, 3 routed experts of 4 neurons
 * each, then a shared expert of 6 (d_mlp 18; neuron 13 of a layer is neuron 1 of the shared expert).
 * @returns {import("../../dpa_widgets/static/src/model.js").Payload}
 */
export function moePayload() {
  const data = payload();
  return {
    ...data,
    d_mlp: 18,
    neurons: { index: [[5, 13, 0], [2, 9]], score: [[0.5, -0.3, 0.1], [-2, 0.3]] },
    token_routes: data.token_routes.map((r, j) => ({ ...r, experts: [[j % 2, j % 4, 0.1 * (j + 1)]] })),
    n_experts: 3,
    d_expert: 4,
    expert_names: ["E0", "E1", "E2", "shared"],
    expert_scores: [[0.2, 0, -0.5, 0.1], [1.2, -0.3, 0, 0.4]],
  };
}

/**
 * The same prompt on a Falcon-H1-like model: every layer runs attention (4 heads in 2 KV groups) and a Mamba-2
 * block (4 SSM heads, "scan" units) side by side, so a row of head scores is 8 wide: the heads, then from column 4
 * the scan units (column 5 is L0.S1). Its routes and top lists reach both kinds.
 * @returns {import("../../dpa_widgets/static/src/model.js").Payload}
 */
export function besidePayload() {
  const data = payload();
  return {
    ...data,
    n_heads: 8,
    n_kv_heads: 2,
    beside: ["scan", 4],
    unit_kinds: ["head", "scan"],
    unit_letters: { head: "H", scan: "S" },
    head_scores: [[0.1, -0.2, 0.3, 0, 0.05, -0.9, 0.2, 0], [1.5, -0.4, 0.05, 0.2, 0.6, 0, -0.7, 0.1]],
    token_routes: data.token_routes.map((r, j) => ({ ...r, heads: [...r.heads, [j % 2, 4 + (j % 4), 0.3 - 0.1 * j]] })),
  };
}

/**
 * A fake anywidget model: get/set/on/off/save_changes/send, with change events on set.
 * kernel: true answers the view's {action: "hello"} at once, as CircuitWidget does in a kernel;
 * false is a static page (nothing answers). emit(event, ...args) fires handlers ("msg:custom").
 */
export function fakeModel(traits, { kernel = true } = {}) {
  const state = { ...traits };
  const handlers = new Map();
  const model = {
    saves: 0,
    sent: [],
    get: (name) => state[name],
    set(name, value) {
      state[name] = value;
      for (const cb of handlers.get(`change:${name}`) ?? []) cb();
    },
    on(event, cb) {
      if (!handlers.has(event)) handlers.set(event, []);
      handlers.get(event).push(cb);
    },
    off(event, cb) {
      handlers.set(event, (handlers.get(event) ?? []).filter((f) => f !== cb));
    },
    save_changes() { model.saves += 1; },
    send(msg) {
      model.sent.push(msg);
      if (kernel && msg && msg.action === "hello") model.emit("msg:custom", { action: "hello", live: !!state._live });
    },
    emit(event, ...args) {
      for (const cb of handlers.get(event) ?? []) cb(...args);
    },
    listeners: () => [...handlers.values()].reduce((n, l) => n + l.length, 0),
  };
  return model;
}

export function traits(overrides = {}) {
  return {
    _data: payload(), _details: {}, _live: true, _busy: false, _error: "", _methods: ["dpa", "tokens:gradient"],
    _comparison: {}, _verify: {}, selected_head: null, selected_neuron: null, selected_expert: null, selected_token: null,
    selection: {},
    target: " Mary", contrast: "", weights_preset: "default", weights_p: 0.5, method: "dpa", top_k: 10,
    ...overrides,
  };
}
