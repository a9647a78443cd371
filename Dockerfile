FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY db ./db
COPY runtime ./runtime
COPY tasks ./tasks
COPY api ./api
COPY cli ./cli
RUN pip install . && useradd --create-home dar
USER dar
EXPOSE 8080 5555
CMD ["sh", "-c", "gunicorn --bind 0.0.0.0:${PORT:-8080} --worker-class gevent --workers ${WEB_CONCURRENCY:-1} --worker-connections ${WEB_CONNECTIONS:-2000} --keep-alive ${WEB_KEEPALIVE:-5} --access-logfile - api.wsgi:app"]
