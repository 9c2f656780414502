"""The book's rules as plain tensor functions, no HF modules.

The forward rules dpa recomputes where it needs alpha itself (``explicit.py``): RMSNorm scale (``norm``), RoPE
rotation (``rope``), attention probabilities with grouped-query heads (``attention``), soft-capping
(``softcap``). And the backward rules the book derives (``hand``: frozen norm, GLU content/control, softmax delta,
RoPE transpose, GQA grouping, q/k norms, and a top-down sweep chaining them): the library does not call those --
it runs them as autograd through the linearised model (``instrument.py``) -- they are the proof, and the tests
check the library against them on every family.
"""
