"""The shared contract: what every process (api, scheduler, worker) imports and agrees on: the wire
(every message), the settings, request limits, socket authentication, prefix block hashes and the
configuration exit. It imports nothing of blockserve outside itself."""
