"""Senders of batch notifications: signed webhooks and plain emails."""
