"""The endpoint's defaults that the CLI and `fedla client status` show too: kept free of heavy imports."""

DEFAULT_PORT = 8765  # 127.0.0.1:8765/v1
DEFAULT_MAX_QUEUE = 64  # requests waiting or running beyond this are answered 503
