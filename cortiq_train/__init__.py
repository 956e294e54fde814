"""Train MTP draft layers for a backbone that has none (``cortiq mtp-train``).

The backbone stays frozen and runs through the engine: ``features`` collects its
pre-norm hidden rows and its next-token distribution (top-k) over a text. The
draft layers train in torch (``draft_torch``, the optional ``[train]`` extra,
imported only when training starts), are written as a standard MTP sidecar
(``export``), and are measured back through the engine's own kernels
(``engine_drafts``). Pieces:

- ``config``       TrainConfig, its checks
- ``backbone``     open a CMF backbone: engine model, tokenizer, f32 tensors
- ``features``     hidden rows + teacher top-k, split into windows, cached in
                   memory-mapped files (resumable); the backbone's own continuations
- ``draft_torch``  the draft layers as torch modules, initialized from the backbone;
                   ``depth_outputs``: every depth's rows, teacher-forced or as drafted
- ``trainer``      the loop: distillation loss, checkpoints, resume
- ``export``       the sidecar file
- ``engine_drafts`` the sidecar run by the engine's numpy/numba layers
"""

from cortiq_train.config import TrainConfig

__all__ = ["TrainConfig"]
