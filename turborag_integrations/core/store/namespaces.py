"""Namespaces: one store, many tenants, and no blob of one reachable from another.

A namespace is a name (a tenant, optionally split further by a cache salt; "" is the default
namespace, today's single one). It enters a blob's key twice (`kv.blob.chunk_key`): the
name is digested with the chunk's tokens, so the same text has an unrelated key in every
namespace, and the namespace's tag ends the key (`<digest>-<tag>`; default keys have no tag), so
a store can tell a key of another namespace without reading anything.

`KVStore.namespace(name)` is the store of one namespace:

- its own disk tier, `<root>/namespaces/<tag>/`, with the store's budgets: eviction, `gc`,
  `shrink`, `verify` and document deletion of one namespace never touch another's files. A
  name "tenant/salt" (a tenant's cache split further by a cache salt, as vLLM's `cache_salt`
  splits its prefix cache) has keys of its own in the tenant's disk tier, so that a tenant's
  salts share the tenant's budget rather than each taking a whole one (and `readable` lets a
  salted request reuse the tenant's chunks, not its heads);
- the memory, accelerator and remote (Redis) tiers of the store it came from, shared: each
  entry's key says whose it is, and a namespace's store asks them only for its own keys — a key
  of another namespace is a miss in `get` and `contains`, is not deleted by `delete`, and is
  left out of `keys`. What sharing still lets through: the memory tiers are bounded together,
  so one namespace's reads can push another's blobs out of RAM (back to its disk tier, never
  removed): a tenant can observe how busy the others are, not what they hold.

Salts come and go (a server may see one per user), so what is kept per salted namespace — its
store object here, its engine view (`TurboRAGEngine.namespaced`) — is kept for the most
recently used ones only (a cachetools `LRUCache`); the blobs themselves stay in the tenant's
disk tier.
"""

from __future__ import annotations

from pathlib import Path

from ..kv.blob import namespace_tag

FOLDER = "namespaces"
MAX_NAMESPACE_CHARS = 256
# The namespace every tenant's prompts may also reuse (texts ingested as public). No tenant
# name or cache salt can spell it: tenants are letters, digits, ".", "_" and "-", salts have
# no "/" (vLLM's rule), so every other namespace is "tenant" or "tenant/salt".
PUBLIC = "*public"


def namespace_of(tenant: str, salt: str | None = None) -> str:
    """The namespace of a tenant's requests, split by a cache salt."""
    return f"{tenant}/{salt}" if salt else tenant


def check_namespace(name: str) -> None:
    """Refuse what cannot be a namespace name: a non-string, NUL, or over 256 characters."""
    if not isinstance(name, str):
        raise TypeError(f"a namespace is a string, not {type(name).__name__}")
    if "\x00" in name or len(name) > MAX_NAMESPACE_CHARS:
        raise ValueError(f"a namespace has at most {MAX_NAMESPACE_CHARS} characters and no NUL "
                         f"(got {len(name)} characters)")


def readable(name: str, public: bool = True) -> tuple[str, ...]:
    """The namespaces whose chunk blobs a request of namespace `name` may reuse, its own first.

    A salt splits what requests compute — prompt heads, and chunks ingested with that salt —
    as vLLM's `cache_salt` splits its prefix cache; what the tenant ingested without a salt is
    its corpus under every salt, so "tenant/salt" reads the tenant's chunks too (never its
    heads: those were computed for requests of another salt). Then the public namespace."""
    names = [name, disk_partition(name)] if "/" in name else [name]
    if public:
        names.append(PUBLIC)
    return tuple(dict.fromkeys(names))


def disk_partition(name: str) -> str:
    """The namespace whose disk tier `name` uses: the tenant of "tenant/salt", else itself."""
    return name.partition("/")[0] if "/" in name else name


def namespace_root(base: Path, name: str) -> Path:
    """Where a namespace's disk tier lives under the store folder `base`."""
    return base / FOLDER / namespace_tag(name) if name else base


def key_in_namespace(key: str, tag: str) -> bool:
    """Whether `key` ends with the namespace tag `tag` ("" : a default-namespace key)."""
    head, sep, tail = key.rpartition("-")
    return tail == tag if tag else not sep


def namespaced_collection(collection: str, namespace: str) -> str:
    """A vector collection name of a namespace's own ("" keeps `collection`): the adapters'
    default Chroma collections, so that tenants never retrieve each other's documents."""
    return f"{collection}-{namespace_tag(namespace)}" if namespace else collection
