"""gradserver as a torch.distributed backend: `import gradserver.worker.torch` registers "gradserver".

This package is the only part of the client library that imports torch at import time; it is a
client of the same coordinator API as `WorkerClient`.
"""
