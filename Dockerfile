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
RUN pip install --no-cache-dir -c constraints.txt . \
 && pip install --no-cache-dir --no-deps -c constraints.txt pipecat-ai
# (the second line: the end-of-turn model's file, in Pipecat's wheel, without its dependencies)

# an unprivileged user owns only the state folder
RUN useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin turnkeeper \
 && mkdir -p /app/var && chown turnkeeper /app/var
USER 10001

ENV TURNKEEPER_HOST=0.0.0.0
EXPOSE 8080
VOLUME ["/app/var"]
# liveness (GET /healthz stays 200 while the server drains)
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('TURNKEEPER_PORT', '8080') + '/healthz', timeout=2)"]
# exec form: the server is PID 1 and gets SIGTERM itself (it drains, then exits)
CMD ["turnkeeper", "serve"]
