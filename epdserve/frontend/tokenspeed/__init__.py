"""TokenSpeed's scheduler gRPC protocol on a prefill or decode front's ``--grpc-port`` (smg's EPD mode): the service
(:mod:`.service`), its request conversion (:mod:`.requests`, :mod:`.items`) and the encoder-room claims
(:mod:`.room_client`)."""
