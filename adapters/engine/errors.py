"""Why a model cannot be served, as errors the command line turns into one line and exit 2.

Every refusal about the model itself (not found, no family serves it, a checkpoint
that does not hold what its config says, a hub id not in the cache) derives from
ModelError, so `fencepost serve` and `fencepost worker` print its message alone,
never a traceback. This module imports nothing, so the command line can name the
class without loading torch.
"""


class ModelError(Exception):
    """A model that cannot be served; the message says why in one line."""
