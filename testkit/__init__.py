"""Test and benchmark tooling: fakes, fault injectors, the ledger fuzzer and
a local OpenAI-compatible server. Never imported by the product packages
(``turn``, ``media``, ``voice``, ``web``; ``tests/test_product_imports.py``
checks it); the tests and ``bench/`` use it.
"""
