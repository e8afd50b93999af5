"""The built-in ghost rules, one module per layer family, registered on import."""

from tf_dp.core.ghost.rules import (conv, dense, einsum, embedding,  # noqa: F401
                                    normalization, recurrent)
