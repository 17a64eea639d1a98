"""What ``kvstore serve`` (:mod:`kvstore.server`) is built from: a request's salt
(:mod:`.request_salts`), the Prometheus registry of a prompt cache (:mod:`.metrics`)
and where ``GET /metrics`` and ``/kvstore/stats`` are answered (:mod:`.listener`).
"""
