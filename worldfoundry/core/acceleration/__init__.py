"""The acceleration lifecycle: registry, installer, session, guard, patch recorder and receipts."""
