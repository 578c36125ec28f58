"""Reading source videos and writing MP4s with PyAV."""
