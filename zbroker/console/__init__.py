"""The console actor: /metrics, the web console and `zbroker top` (docs/console.md)."""
