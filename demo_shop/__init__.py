"""The demo shop: an example of tools with real side effects, and the
external system they act on.

``service`` is the in-process shop, payment processor and messaging
provider (its own SQLite table, each idempotency key applied once);
``tools`` the agent's tools on it (``lookup_weather``, ``create_order``,
``charge_payment``, ``send_messages``) and the worker that sends queued
messages; ``shop`` wires both for one server. The server runs it by default
so ``make run`` shows the ledger at work; setting ``demo_shop`` (env
``TURNKEEPER_DEMO_SHOP``) false turns it off. Only ``web/app.py`` knows it,
behind that setting.
"""
