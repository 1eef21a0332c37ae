"""The headless WebRTC client: ``turnkeeper call``'s driver, and the
end-to-end tests' and benchmarks' caller. It talks to a server only over
HTTP and WebRTC, like a browser; the server packages never import it.
"""
