"""The HTTP API's bodies, shared by the node (api) and its clients (fleet): msgspec
Structs only, nothing of the server."""
