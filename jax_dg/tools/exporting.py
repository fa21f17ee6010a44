"""jax.export of functions that call jax_dg ops.

jax.export refuses custom calls without a compatibility guarantee unless told otherwise:

    exp = jax.export.export(jax.jit(f), disabled_checks=jax_dg.export_safety_checks())(*specs)
    blob = exp.serialize()
    # ... in another process that has imported jax_dg (which registers the targets):
    y = jax.export.deserialize(blob).call(*args)

What jax_dg guarantees: a module exported with one jax_dg version runs with the same version
(the bridge's custom calls carry a versioned call-site record, jax_dg.core.site, naming the op,
the backend the function was traced for and its static attributes; a record of another
version is refused with a message). M of the GEMMs and of the MQA ops may be symbolic
(jax.export.symbolic_shape); sizes that shape an output (max_seqlen_k, max_model_len, ...)
are static.
"""

from __future__ import annotations

import jax

from jax_dg.core import op, values

__all__ = ["export_safety_checks"]


def export_safety_checks() -> list:
    """The jax.export DisabledSafetyCheck list for every custom-call target of jax_dg."""
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in (*op.targets(), values.TARGET)]
