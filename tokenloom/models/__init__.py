"""Model code that model plugins share and build on, above :mod:`tokenloom.layers`: the
decoder-only causal-LM skeleton (:mod:`tokenloom.models.causal_lm`). Plugin authors import it
from :mod:`tokenloom.model_api`."""
