"""What several test files share: the small GPT and the two optimizers most parity tests train, the zoo of
models beyond GPT (BERT, ViT, a user's ``Net`` with its ``NET_POLICY``, their batches), and references written
in plain torch so that they check the engine rather than repeat it. Test files import from here, not from
each other.

``plain_mixed_precision``: the mixed-precision recipe in one process, nothing from ``colab_kit.precision``: the
model cast to 16 bits, fp32 copies made from the 16-bit weights that the optimizer steps, the loss taken in
fp32 from the 16-bit logits, the 16-bit gradients cast to fp32 and unscaled (fp16 scales the loss by 2^16,
the engine's first scale, as ``torch.amp.GradScaler`` does), the stepped copies cast back.

``trained_like``: parameters count as trained like the reference when they are off its by under a tenth of
what training moved the reference from where it started, over the whole model. The untrained weights are off
by the whole update (ratio 1.0), so the check rejects them: each test that uses it asserts that too.
"""
from __future__ import annotations

from .plans import *  # noqa: F401,F403
from .processes import *  # noqa: F401,F403
from .references import *  # noqa: F401,F403
from .zoo import *  # noqa: F401,F403
