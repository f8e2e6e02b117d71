"""Real keras-io example programs shrunk to tiny synthetic data, one module per example.

Each module defines `model_fn()` (builds and compiles the example's model, smaller) and
`train(fit, workdir)` (makes seeded synthetic data of the example's shapes and dtypes, prepares it
as the example does, and calls `fit(...)` with the keyword arguments the example passes to
`model.fit`), or `script(strategy, fit, workdir)` (the whole program, with what makes variables in
`strategy.scope()` and every `model.fit(...)` written `fit(model, ...)`; it returns the last fit's
History), or both. `m.train(m.model_fn().fit, tmp)` and `m.script(strategy, keras.Model.fit, tmp)`
run the example with Keras' own fit; `m.train(functools.partial(other_fit, m.model_fn), tmp)` and
`m.script(strategy, other_fit, tmp)` run it with another fit of the same signature. Importing a
module runs no TensorFlow. See README.md for sources and deviations.
"""

import importlib
import pkgutil


def ports(entry=None):
    """The names of the example modules, sorted; with `entry` ("model_fn", "script"), those that define it."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return [name for name in names if entry is None or hasattr(importlib.import_module(f"{__name__}.{name}"), entry)]
