"""The worker: claims queued requests, runs them on engines, finalizes batches."""
