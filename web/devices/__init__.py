"""Push-to-talk devices over a WebSocket: the xiaozhi-esp32 firmware's
protocol (78/xiaozhi-esp32, docs/websocket.md)."""
