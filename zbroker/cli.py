def main() -> None:  # replaced by the real CLI
    raise SystemExit("zbroker CLI not built yet")
