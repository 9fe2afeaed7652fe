"""The stream service: sessions of apps in private X displays (or a test pattern), encoded once
with PyAV (h264_nvenc or libx264) and sent to WebRTC viewers (aiortc), with input back."""
