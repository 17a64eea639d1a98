"""The platform layer: what kvstore needs of the operating system, MLX's devices and
mlx-lm, each with portable fallbacks.

Modules: :mod:`.fsutil` (file primitives), :mod:`.memutil` (prefaulting, page
residency), :mod:`.devices` (where MLX keeps arrays), :mod:`.compat` (the supported
mlx-lm range and ``kvstore serve``'s start-up check), :mod:`.default_model` (the
model the commands use when none is named), :mod:`.gate` (a readers-writer gate for
threads) and :mod:`.mlxsync` (MLX's stream syncs wait for kvstore's loads). Nothing here imports the rest of kvstore.
"""
