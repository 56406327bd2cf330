"""TurboRAG and RAPID for LlamaIndex and LangChain.

The framework-free engine lives in `turborag_integrations.core`; the adapters in
`turborag_integrations.llama_index` and `turborag_integrations.langchain` import their framework
only when used.
"""

from .core.environment import settle_openmp

settle_openmp()  # before anything loads torch: OpenMP reads its environment once, then

from .core.engine import GenerationResult, TurboRAGEngine  # noqa: E402
from .core.prompt_template import render_chat  # noqa: E402
from .core.run import GenerationStats  # noqa: E402
from .core.settings import GenerationConfig  # noqa: E402
from .core.store import KVStore  # noqa: E402

__all__ = ["TurboRAGEngine", "GenerationConfig", "GenerationResult", "GenerationStats", "KVStore",
           "render_chat"]
__version__ = "0.1.0"
