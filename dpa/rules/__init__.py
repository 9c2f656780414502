"""The readable forward rules dpa recomputes where it needs alpha itself (``explicit.py``).

Plain tensor functions, no HF modules: RMSNorm scale, RoPE rotation, attention probabilities with
grouped-query heads. The backward rules the book derives (frozen norm, GLU content/control, softmax
delta, RoPE transpose) are not here: the library runs them as autograd through the linearised model
(``instrument.py``); the book and ``tests/hand_rules.py`` write them out and prove the two equal.
"""
