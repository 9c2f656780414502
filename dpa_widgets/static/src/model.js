// @ts-check
/**
 * Circuit inspector for a Dual Path Attribution result: no framework, no network. The sources are the modules
 * of dpa_widgets/static/src/ (graph.js, the circuit graph view, is shared with the CLI's page), assembled when
 * the widget is first imported by dpa_widgets/bundle.py into the one ES module the widget loads (its ``_esm``):
 * in the order of their imports, with the import lines taken out.
 * The pure helpers (colour scale, ranking, layout, export, graph pruning) are exported so that Node's test
 * runner can test them without a DOM.
 *
 * @typedef Model  The widget's traits, snake_case on both sides (dpa_widgets/circuit.py).
 * @property {Payload} _data                  the attribution as the view draws it
 * @property {Record<string, Detail>} _details  head / neuron / expert details by key ("head:L:H", "neuron:L:N",
 *   "expert:L:S")
 * @property {boolean} _live                  a model is attached: the controls recompute in the kernel. Saved
 *   state keeps it true (a book page), so the view trusts it only once a kernel answered its "hello"
 *   message (see Kernel below): with no answer the page is static and the controls stay off.
 * @property {boolean} _busy                  the kernel is computing
 * @property {string} _error                  the last error message ("" = none)
 * @property {string[]} _methods              "dpa" and the baselines the kernel offers
 * @property {Comparison} _comparison         the current baseline against DPA ({} for DPA)
 * @property {Verification} _verify           the last ablation check ({} = none yet)
 * @property {number[] | null} selected_head  [layer, head]
 * @property {number[] | null} selected_neuron [layer, neuron]
 * @property {number[] | null} selected_expert [layer, slot] (mixture of experts; null on a dense model)
 * @property {number | null} selected_token   a position
 * @property {Record<string, any>} selection  the selection as JSON (written by this view)
 * @property {string} target                  target token ("" = the model's prediction)
 * @property {string} contrast                contrast foil ("" = none)
 * @property {string} weights_preset          "default", "custom" (the result's own weights) or a sensitivity family
 * @property {string[]} _presets               the weights_preset choices on offer
 * @property {number} weights_p               p of the family, in [0, 1]
 * @property {string} method                  "dpa" or a baseline name
 * @property {number} top_k                   k for "top-k" ablation and top lists
 * @property {import("./graph.js").GraphData | {}} _graph  the circuit graph (Circuit.to_json(),
 *   plus "verifiable": the kernel holds its tensors), {} without one
 * @property {Record<string, import("./graph.js").Verified>} _graph_verify  path-patching results
 *   by "source->destination"
 * @property {"scores" | "graph"} view         which view is shown (the graph only with a circuit)
 * @property {string} selected_node            the graph's selected node label ("" = none)
 * @property {string[] | null} selected_edge   the graph's selected edge: [source label, destination label]
 * @property {number} graph_threshold          the graph's pruning threshold: the share of the units' influence kept
 *
 * @typedef {"connecting" | "live" | "none"} Kernel  whether a kernel answered the view's
 *   {action: "hello"} (CircuitWidget._on_message replies {action: "hello", live}): "connecting" until
 *   it does or timing.helloMs pass, then "none" (a static page: book, save_html) unless a late answer comes.
 *
 * @typedef Payload
 * @property {string[]} tokens
 * @property {number[]} token_scores
 * @property {boolean[]} special
 * @property {{kind: string, position: number, token: string|null, token_id: number|null,
 *   contrast: string|null, contrast_id: number|null, probability: number|null, logprob: number|null,
 *   terms: {position: number, token: string|null, value: number, probability: number|null, contrast: boolean}[]|null}} target
 * @property {number} target_logit
 * @property {number} completeness_gap
 * @property {string[]} [caveats]             what dpa cannot vouch for (Attribution.caveats)
 * @property {Record<string, number>} weights  query, key, value, gate, up (and router, expert on a mixture of experts)
 * @property {string} method
 * @property {string} model_name
 * @property {number} n_layers
 * @property {number} n_heads               the width of a row of head_scores (beside attention: its heads, then the units
 *   beside them)
 * @property {number} n_kv_heads             (the attention heads')
 * @property {string[]} [layer_kinds]         a hybrid of one kind of unit per layer: each row's ("head", "conv", "scan",
 *   "mlp")
 * @property {[string, number]} [beside]      attention and a mixer side by side in every layer (Falcon-H1's): the
 *   mixer's unit kind and the first column of its units (head_scores[l][c] for c >= beside[1] is unit c - beside[1])
 * @property {string[]} [unit_kinds]          a hybrid's or beside attention's kinds of unit, in order ("head", "scan")
 * @property {Record<string, string>} [unit_letters]  each kind's letter in labels ("H", "S", "C")
 * @property {Record<string, number>} [unit_widths]   a convolution unit's channels of the residual stream
 * @property {number} d_mlp
 * @property {number[][]} head_scores         [layer][head]
 * @property {number[]} mlp_totals            [layer] sum of all neuron scores
 * @property {{index: number[][], score: number[][]}} neurons  top neurons per layer by |score|
 * @property {[string, number][]} top_predictions
 * @property {Route[] | null} token_routes    per position: the components that route the token
 * @property {number} [n_experts]             mixture of experts only (absent on a dense model): routed experts
 * @property {number | null} [d_expert]       ... neurons per routed expert: neuron n of a layer is neuron
 *   n % d_expert of expert n // d_expert, the shared expert's after n_experts * d_expert (null: not known)
 * @property {string[]} [expert_names]        ... one per slot: "E0" .. "E{n-1}", then "shared" if there is one
 * @property {number[][]} [expert_scores]     ... [layer][slot]
 * @property {number[] | null} [dense_layers] ... the layers whose MLP is dense (Jamba's, Qwen's mlp_only_layers): no
 *   experts there, their neurons the dense MLP's; null: every layer's MLP is the sparse block
 *
 * @typedef Route
 * @property {[number, number, number][]} heads    [layer, head, score of edges with this key]
 * @property {[number, number, number][]} neurons  [layer, neuron, score at this position]
 * @property {[number, number, number][]} [experts] [layer, slot, score at this position] (mixture of experts)
 *
 * @typedef Detail
 * @property {"head" | "neuron" | "expert"} kind
 * @property {number} layer
 * @property {number} index
 * @property {number} score
 * @property {number[][] | null} [edges]      head: [query][key] edge scores
 * @property {number[] | null} [by_key]       head: per key position (sum over queries)
 * @property {number[] | null} [by_pos]       neuron or expert: per position
 * @property {[string, number][] | null} [promotes]    neuron: tokens its output direction raises
 * @property {[string, number][] | null} [suppresses]
 * @property {string} [no_vocab]            neuron: why there are no tokens with the model at hand (the lens refused)
 * @property {string} [unit]                 head: the unit's kind ("head", "scan", "conv")
 * @property {number} [unit_index]           head: its index among its kind's in the row
 * @property {string} [label]                head: "L0.H2", "L0.S1"
 *
 * @typedef Comparison
 * @property {string} [method]
 * @property {"input" | "component"} [level]
 * @property {number[]} [token_scores]
 * @property {(number | null)[][]} [head_scores]  (null: a unit the method does not score, beside attention)
 * @property {number | null} [rho]            Spearman rank correlation with DPA (tokens or heads)
 * @property {number | null} [rho_neurons]    ... and on neurons, for component methods that score them
 *
 * @typedef Verification
 * @property {string} [mode]
 * @property {string[]} [units]
 * @property {number} [p_before]
 * @property {number} [p_after]
 * @property {string} [token]
 */

