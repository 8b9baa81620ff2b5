"""Call ``Encode`` on a running encoder with one photo and print what came back.

    python -m epdserve.encoder.server --port 50051 &
    python examples/encode_grpc.py --addr 127.0.0.1:50051 ../shared/images/chelsea.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc

from epdserve.encoder.grpc_codec import tensor_from_proto
from epdserve.proto import encoder_pb2, encoder_pb2_grpc

DEFAULT_IMAGE = Path(__file__).resolve().parents[2] / "shared" / "images" / "chelsea.png"


def main() -> None:
    """Parse arguments, send one image, print hash / grid / token count / embedding shape and dtype."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image", nargs="?", default=str(DEFAULT_IMAGE), help="image file (default: %(default)s)")
    parser.add_argument("--addr", default="127.0.0.1:50051", help="encoder address host:port (default: %(default)s)")
    parser.add_argument("--request-id", default="example-0", help="request id sent to the encoder")
    args = parser.parse_args()

    data = Path(args.image).read_bytes()
    # Embeddings come back in the response (no targets), so allow large replies.
    options = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
    with grpc.insecure_channel(args.addr, options=options) as channel:
        stub = encoder_pb2_grpc.EncoderStub(channel)
        request = encoder_pb2.EncodeRequest(request_id=args.request_id, images=[encoder_pb2.Image(data=data)])
        try:
            response = stub.Encode(request, timeout=120)
        except grpc.RpcError as e:
            raise SystemExit(f"Encode failed: {e.code().name}: {e.details()}")
    for result in response.images:
        emb = tensor_from_proto(result.embedding)
        print(f"image_hash  {result.image_hash}")
        print(f"grid_thw    {list(result.grid_thw)}")
        print(f"num_tokens  {result.num_tokens}")
        print(f"embedding   {list(emb.shape)} {result.embedding.dtype}")
        print(f"cache_hit   {result.cache_hit}")


if __name__ == "__main__":
    main()
