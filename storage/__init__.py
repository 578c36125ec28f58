"""What the API and the workers share: blob storage (S3-compatible) and job records (Redis)."""
