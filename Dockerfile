# turnkeeper server image. WebRTC media uses ephemeral UDP ports, so run it
# with host networking:  docker run --network host turnkeeper
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends espeak-ng \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY clock ./clock
COPY turn ./turn
COPY media ./media
COPY voice ./voice
COPY web ./web
COPY client ./client
COPY demo_shop ./demo_shop
COPY testkit ./testkit
RUN pip install --no-cache-dir -c constraints.txt .

ENV TURNKEEPER_HOST=0.0.0.0
EXPOSE 8080
VOLUME ["/app/var"]
CMD ["turnkeeper", "serve"]
