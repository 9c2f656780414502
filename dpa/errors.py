"""dpa's errors: one base class, each also the matching built-in (so ``except ValueError`` still works)."""

from __future__ import annotations


class DPAError(Exception):
    """Base of every error dpa raises on purpose."""


class UnsupportedModelError(DPAError, ValueError):
    """The model or one of its config settings is not handled by dpa."""


class InputError(DPAError, ValueError):
    """A prompt or option that cannot be attributed (empty, too long, wrong type or value)."""


class OutputError(InputError):
    """A file that cannot be written where asked (a directory, a full disk, no permission): the message names the
    path and the system's reason, ``errno`` holds its code (None where dpa refused the path itself)."""

    errno: int | None = None


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type (a string where a number goes, a float where a token id goes)."""


class TargetError(DPAError, ValueError):
    """A target that cannot be attributed as asked (e.g. a string that is several tokens)."""


class NonFiniteError(DPAError, FloatingPointError):
    """NaN or infinite values appeared (weights, activations, targets or scores)."""


def non_finite_parameter(module) -> str | None:
    """The name of ``module``'s first parameter holding a NaN or an inf, or None: what a ``NonFiniteError`` names
    first where it is the cause (only looked for once a value is found not finite)."""
    import torch

    return next((name for name, p in module.named_parameters() if not bool(torch.isfinite(p).all())), None)


def non_finite_cause(model, otherwise: str | None = None) -> str | None:
    """"the model's parameter X is NaN or inf" for ``model``'s first such parameter, else ``otherwise``."""
    weight = non_finite_parameter(model)
    return f"the model's parameter {weight} is NaN or inf" if weight else otherwise


class ModelStateError(DPAError, RuntimeError):
    """The model is in a state dpa cannot attribute (e.g. already instrumented by this thread)."""


class TargetWarning(UserWarning):
    """A target string that is probably not the spelling meant (e.g. 'Paris' where ' Paris' is likely)."""
