# One image for web, worker and beat. Build: docker build -t whalezen .
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY requirements.txt .
RUN pip install -r requirements.txt
COPY . .
RUN DJANGO_ENV=production DJANGO_SECRET_KEY=build-only-not-secret-build-only-not-secret-0123456789 \
    python manage.py collectstatic --noinput
EXPOSE 8000
CMD ["gunicorn", "broker.wsgi", "--bind", "0.0.0.0:8000", "--workers", "3", "--timeout", "60"]
