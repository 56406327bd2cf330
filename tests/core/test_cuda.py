"""The engine on a CUDA device (skipped without one; `benchmarks/gpu.py` runs the same checks).

Blobs from the host store and caches on the device: assembly must move keys before rotating.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.prefill.stitch import Segment, plan_prompt, reference_forward
from turborag_integrations.core.store import KVStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TEXT = "The lighthouse at Tall Widow Point is 38 meters high and was built in 1871."
OTHER = "The harbour archive holds maps of every reef between the two capes."


@pytest.mark.parametrize("accelerator_bytes", [0, 64 << 20])
def test_stitched_prefill_on_cuda_equals_masked_forward(tmp_path, accelerator_bytes):
    loaded = tiny_model("qwen2", seed=1)
    loaded.model.to("cuda")
    engine = TurboRAGEngine(loaded, store=KVStore(tmp_path, accelerator_bytes=accelerator_bytes),
                            progress=False)
    engine.encode_chunks([TEXT, OTHER])
    segs = [Segment("<s>user\n"), Segment(TEXT, engine.library.blob_for(TEXT)),
            Segment(OTHER, engine.library.blob_for(OTHER)), Segment(" How high is it?\n")]
    pre = engine.prefill(segs, reserve=4)
    ref = reference_forward(loaded.model, plan_prompt(segs, engine.tokenizer))
    assert (pre.logits.float() - ref[-1]).abs().max().item() < 1e-4
    out = engine.generate("<s>user\n" + TEXT + OTHER + " How high?\n", chunks=[TEXT, OTHER],
                          config=GenerationConfig(max_new_tokens=4))
    assert len(out.token_ids) == 4
