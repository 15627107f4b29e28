"""The commit writer actor: coalesces offset advances and makes them durable in batches.

`core` decides (pure), `shell` is the process main (`shell.run`).
"""
