"""TurboRAG and RAPID for LlamaIndex and LangChain.

The framework-free engine lives in `turborag_integrations.core`; the adapters in
`turborag_integrations.llama_index` and `turborag_integrations.langchain` import their framework
only when used.
"""

from .core.engine import GenerationResult, TurboRAGEngine
from .core.run import GenerationStats
from .core.settings import GenerationConfig
from .core.store import KVStore

__all__ = ["TurboRAGEngine", "GenerationConfig", "GenerationResult", "GenerationStats", "KVStore"]
__version__ = "0.1.0"
